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

from collections.abc import Callable

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


def catalog_problems(
    models: list[CatalogModel], label: Callable[[int], str] = lambda i: f"models[{i}]."
) -> list[str]:
    """What makes a set of entries unusable together, each naming its field
    (``label(i)`` prefixes the fields of entry ``i``).

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
            where = f"{label(i)}adapters[{j}].name"
            if adapter.name in names:
                problems.append(f"{where}: {adapter.name!r} is also a model's name")
            elif adapter.name in seen:
                problems.append(
                    f"{where}: {adapter.name!r} is already an adapter of {seen[adapter.name]}"
                )
            seen.setdefault(adapter.name, model.name)
        if model.profile.runtime_lora and model.engine is not EngineKind.VLLM:
            problems.append(
                f"{label(i)}profile.runtime_lora: only vLLM loads adapters at runtime "
                f"({model.engine.value} loads them at start)"
            )
    return problems


def problems_with(
    entries: list[CatalogModel],
    existing: list[CatalogModel],
    label: Callable[[int], str] = lambda i: f"models[{i}].",
) -> list[str]:
    """What ``entries`` break in a catalog holding ``existing`` (an entry
    replaces the existing one of its name). Problems the rest of the catalog
    had already are not theirs to answer for. Entries are labelled by
    ``label(index)``, the others by their name."""
    mine = {e.name for e in entries}
    others = [e for e in existing if e.name not in mine]

    def other(i: int) -> str:
        return f"model {others[i].name}: "

    before = set(catalog_problems(others, other))
    # The catalog first: a clash is blamed on the entry that comes to it.
    n = len(others)
    after = catalog_problems([*others, *entries], lambda i: other(i) if i < n else label(i - n))
    return [p for p in after if p not in before]
