"""The catalog file: models and their profiles, applied with ``llmgw model apply``.

::

    models:
      - name: tiny
        engine: llama.cpp
        source: /srv/models/tiny.gguf
        replicas: 2
        profile: {tp: 1, nodes: 1}

Unknown fields are errors (a misspelt ``replicas`` must not silently mean 1),
and every error names the field it is about. Replica counts are bounded by
``LLMGW_MAX_REPLICAS_PER_MODEL`` (``replicas``, ``autoscale.min_replicas``
and ``autoscale.max_replicas``): a typo of 1000 must not start a thousand
placements; the error names the limit.
"""

from collections.abc import Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw.engine_flags import LLAMA_SLOT_FLAGS, owned_flag_problems
from llmgw.errors import ConfigError
from llmgw.types import EngineKind, ModelSpec

# LLMGW_MAX_REPLICAS_PER_MODEL's default (llmgw/settings.py).
DEFAULT_MAX_REPLICAS = 64


def replica_problems(entry: "CatalogModel", limit: int, where: str = "") -> list[str]:
    """The entry's replica counts past ``limit``, each naming its field (prefixed
    by ``where``) and the limit."""
    counts = {"replicas": entry.replicas}
    if entry.autoscale is not None:
        counts["autoscale.min_replicas"] = entry.autoscale.min_replicas
        counts["autoscale.max_replicas"] = entry.autoscale.max_replicas
    return [
        f"{where}{field}: {count} is more than LLMGW_MAX_REPLICAS_PER_MODEL ({limit})"
        for field, count in counts.items()
        if count > limit
    ]


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


def parse_catalog(text: str, max_replicas: int = DEFAULT_MAX_REPLICAS) -> list[CatalogModel]:
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
    problems = catalog_problems(catalog.models, max_replicas=max_replicas)
    if problems:
        raise ConfigError("; ".join(problems))
    return catalog.models


def catalog_problems(
    models: list[CatalogModel],
    label: Callable[[int], str] = lambda i: f"models[{i}].",
    max_replicas: int = DEFAULT_MAX_REPLICAS,
) -> list[str]:
    """What makes a set of entries unusable together, each naming its field
    (``label(i)`` prefixes the fields of entry ``i``), or alone (replica
    counts past ``max_replicas``).

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
        problems += replica_problems(model, max_replicas, label(i))
        # Flags that set what llmgw sets (the model, address, key, adapters...).
        problems += owned_flag_problems(model.engine, model.engine_args, f"{label(i)}engine_args")
        problems += owned_flag_problems(
            model.engine, model.profile.engine_args, f"{label(i)}profile.engine_args"
        )
        for j, adapter in enumerate(model.adapters):
            where = f"{label(i)}adapters[{j}].name"
            if adapter.name in names:
                problems.append(f"{where}: {adapter.name!r} is also a model's name")
            elif adapter.name in seen:
                problems.append(
                    f"{where}: {adapter.name!r} is already an adapter of {seen[adapter.name]}"
                )
            seen.setdefault(adapter.name, model.name)
        problems += slot_problems(model, label(i))
        if model.profile.runtime_lora and model.engine is not EngineKind.VLLM:
            problems.append(
                f"{label(i)}profile.runtime_lora: only vLLM loads adapters at runtime "
                f"({model.engine.value} loads them at start)"
            )
    return problems


# llama.cpp flags that routing.slots sets (docs/guides/routing.md, "llama.cpp slots").
def slot_problems(model: CatalogModel, prefix: str) -> list[str]:
    """Why ``routing.slots`` cannot be honoured for ``model``: pinning is a
    llama.cpp request field, and the engine's slot flags are then llmgw's."""
    if not model.routing.slots:
        return []
    if model.engine is not EngineKind.LLAMA_CPP:
        return [
            f"{prefix}routing.slots: only llama.cpp has slots to pin ({model.engine.value} "
            "shares one prefix cache among its requests): leave it 0"
        ]
    given = [a for a in (*model.engine_args, *model.profile.engine_args) if a in LLAMA_SLOT_FLAGS]
    return [f"{prefix}engine_args: {flag} is decided by routing.slots: remove it" for flag in given]


def problems_with(
    entries: list[CatalogModel],
    existing: list[CatalogModel],
    label: Callable[[int], str] = lambda i: f"models[{i}].",
    max_replicas: int = DEFAULT_MAX_REPLICAS,
) -> list[str]:
    """What ``entries`` break in a catalog holding ``existing`` (an entry
    replaces the existing one of its name). Problems the rest of the catalog
    had already are not theirs to answer for. Entries are labelled by
    ``label(index)``, the others by their name."""
    mine = {e.name for e in entries}
    others = [e for e in existing if e.name not in mine]

    def other(i: int) -> str:
        return f"model {others[i].name}: "

    before = set(catalog_problems(others, other, max_replicas))
    # The catalog first: a clash is blamed on the entry that comes to it.
    n = len(others)
    after = catalog_problems(
        [*others, *entries], lambda i: other(i) if i < n else label(i - n), max_replicas
    )
    return [p for p in after if p not in before]
