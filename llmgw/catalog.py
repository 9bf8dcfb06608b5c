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
from llmgw.types import ModelSpec


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
    names = [m.name for m in catalog.models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"models: duplicate names {', '.join(dupes)}")
    return catalog.models
