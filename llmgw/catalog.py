"""The catalog file: models and their profiles, applied with ``llmgw model apply``.

::

    models:
      - name: tiny
        engine: llama.cpp
        source: /srv/models/tiny.gguf
        replicas: 2
        profile: {tp: 1, nodes: 1}

Unknown fields are errors (a misspelt ``replicas`` must not silently mean 1),
and every error names the field it is about.
"""

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw.errors import ConfigError
from llmgw.types import EngineKind, ModelSpec


class CatalogModel(ModelSpec):
    """One model entry of the file: a ModelSpec plus its desired replicas."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(default=1, ge=0)

    def spec(self) -> ModelSpec:
        """The entry without the catalog-only fields."""
        return ModelSpec.model_validate(self.model_dump(exclude={"replicas"}))


class CatalogFile(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="forbid")

    models: list[CatalogModel]


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_catalog(text: str) -> list[CatalogModel]:
    """The models of a catalog file, or a ConfigError naming every bad field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}") from exc
    try:
        catalog = CatalogFile.model_validate(data)
    except ValidationError as exc:
        problems = [f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("; ".join(problems)) from exc
    problems = catalog_problems(catalog.models)
    if problems:
        raise ConfigError("; ".join(problems))
    return catalog.models


def catalog_problems(models: list[CatalogModel]) -> list[str]:
    """What makes a set of entries unusable together, each naming its field.

    Clients address an adapter as the OpenAI ``model``, so adapter names
    share one namespace with model names.
    """
    problems: list[str] = []
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"models: duplicate names {', '.join(dupes)}")
    seen: dict[str, str] = {}
    for i, model in enumerate(models):
        for j, adapter in enumerate(model.adapters):
            where = f"models[{i}].adapters[{j}].name"
            if adapter.name in names:
                problems.append(f"{where}: {adapter.name!r} is also a model's name")
            elif adapter.name in seen:
                problems.append(
                    f"{where}: {adapter.name!r} is already an adapter of {seen[adapter.name]}"
                )
            seen.setdefault(adapter.name, model.name)
        if model.profile.runtime_lora and model.engine is not EngineKind.VLLM:
            problems.append(
                f"models[{i}].profile.runtime_lora: only vLLM loads adapters at runtime "
                f"({model.engine.value} loads them at start)"
            )
    return problems
