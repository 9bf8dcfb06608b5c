"""The Temporal page (reference/temporal.md): the workflow classes of
``workflows/``, their signals, updates and queries, with example inputs.
"""

import enum
import importlib
import inspect
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from refgen.common import (
    anchor_of,
    doc_of,
    model_table,
    models_closure,
    module_of,
    nested_models,
    plain_factory,
    type_name,
)
from refgen.meanings import field_meaning

_STARTED = {
    "Fleet": ("fleet", "the control worker, once"),
    "Deployment": ("deployment/<model>", "`llmgw scale`, reconcile, an operator"),
    "Replica": ("replica/<id>", "a deployment, `llmgw deploy`, an operator"),
    "Rendezvous": ("rendezvous/<replica>", "a multi-node Replica (child workflow)"),
    "DrainNode": ("drain-node/<node>/<any>", "`llmgw node drain`, an operator"),
    "AdapterLoad": ("adapter/<replica>/<adapter>", "a router (on-demand LoRA)"),
    "ShardLogs": ("logs/<replica>/<any>", "`llmgw logs`, the admin API"),
}
_INTERNAL = {
    "register_node": "agents",
    "deregister_node": "agents",
    "place": "the `place_replica` activity",
    "place_batch": "the `place_replica` activity",
    "release": "Replica workflows",
    "replica_ready": "its Replica workflows",
    "replica_ended": "its Replica workflows",
    "report_load": "routers",
    "wake": "routers (an operator may call it too)",
    "adapters_changed": "the AdapterLoad workflow",
}


def _placeholder(tp: Any, name: str, depth: int = 0) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        real = [a for a in args if a is not type(None)]
        return _placeholder(real[0], name, depth) if real else None
    if origin is typing.Literal:
        return args[0]
    if origin in (list, tuple, set, frozenset):
        return []
    if origin is dict:
        return {}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _example(tp, full=False, depth=depth + 1)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(iter(tp)).value
    simple = {bool: True, int: 1, float: 1.0, str: f"<{name}>"}
    return simple.get(tp, f"<{name}>") if isinstance(tp, type) else f"<{name}>"


def _example(
    model: type[BaseModel], full: bool = True, depth: int = 0, blocks: bool = True
) -> dict[str, Any]:
    """A valid input: required fields filled; with ``full``, scalar defaults
    and optional blocks too (one level down)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        nested = list(nested_models(field.annotation))
        if field.is_required():
            out[name] = _placeholder(field.annotation, name, depth)
        elif full and blocks and nested and depth == 0 and field.default is None:
            # An optional block (autoscale's policy): shown with its defaults.
            out[name] = _example(nested[0], full=True, depth=depth + 1)
        elif full and not nested:
            factory = field.default_factory
            if factory is not None and not plain_factory(factory):
                continue  # computed when made: no example value
            value = factory() if factory else field.default  # type: ignore[call-arg]
            if isinstance(value, enum.Enum):
                value = value.value
            if isinstance(value, str | int | float | bool):
                out[name] = value
    return out


def _input_type(fn: Callable[..., Any]) -> type[BaseModel] | None:
    hints = typing.get_type_hints(fn)
    hints.pop("return", None)
    for tp in hints.values():
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp
    return None


def _return_type(fn: Callable[..., Any]) -> str:
    tp = typing.get_type_hints(fn).get("return")
    return type_name(tp, lambda m: f"[{m.__name__}](#{anchor_of(m)})") if tp is not None else ""


def _types_of(fn: Callable[..., Any]) -> list[type[BaseModel]]:
    """The pydantic models a handler takes and returns."""
    return [m for tp in typing.get_type_hints(fn).values() for m in nested_models(tp)]


def _workflow_classes() -> list[type]:
    import workflows  # noqa: PLC0415

    found: list[type] = []
    for path in sorted(Path(workflows.__file__).parent.glob("*.py")):
        module = importlib.import_module(module_of(path))
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if hasattr(cls, "__temporal_workflow_definition") and cls not in found:
                found.append(cls)
    return found


def _message(kind: str, name: str, fn: Callable[..., Any], wf_id: str) -> str:
    model = _input_type(fn)
    who = _INTERNAL.get(name)
    out = [f"### {kind} `{name}`\n\n"]
    doc = doc_of(fn)
    out.append(" ".join(x for x in (f"Sent by {who}." if who else "", doc) if x) + "\n\n")
    verb = {
        "update": "workflow update execute",
        "signal": "workflow signal",
        "query": "workflow query",
    }[kind]
    command = f"temporal {verb} --workflow-id {wf_id} --name {name}"
    if model is not None:
        command += f" \\\n  --input '{json.dumps(_example(model))}'"
    said = [f"Input: [{model.__name__}](#{anchor_of(model)})."] if model is not None else []
    returns = _return_type(fn)
    if returns and returns != "null":
        said.append(f"Returns: {returns}.")
    out.append(" ".join(said) + f"\n\n```sh\n{command}\n```\n\n")
    return "".join(out)


def temporal_page() -> str:
    from temporalio import workflow  # noqa: PLC0415

    parts = [
        "# Workflows, signals, updates and queries\n\n",
        "Every workflow the control worker runs (task queue `control`) and every signal, "
        "update and query it answers, read from the workflow classes in `workflows/`. "
        "Inputs are JSON as pydantic serialises them (`llmgw/types`); the examples fill "
        "required fields with placeholders and show scalar defaults. Messages marked "
        '"sent by" are llmgw\'s own traffic: an operator reads them, rarely sends them. '
        "`temporal` is the CLI in `.venv/bin`; the guide is "
        "[Operating through Temporal](../guides/temporal.md).\n\n",
    ]
    inputs: list[type[BaseModel]] = []
    for cls in _workflow_classes():
        defn = workflow._Definition.must_from_class(cls)
        wf_id, starter = _STARTED.get(defn.name or "", ("<id>", ""))
        parts.append(f"## {defn.name}\n\n`{cls.__module__}.{cls.__name__}`: {doc_of(cls)}\n\n")
        parts.append(
            f"Workflow id `{wf_id}`." + (f" Started by {starter}.\n\n" if starter else "\n\n")
        )
        run_input = _input_type(defn.run_fn)
        inputs.extend(_types_of(defn.run_fn))
        if run_input is not None:
            # A start's optional blocks are carried state (continue-as-new), not input.
            example = json.dumps(_example(run_input, blocks=False))
            parts.append(
                f"Input: [{run_input.__name__}](#{anchor_of(run_input)}). "
                f"Returns: {_return_type(defn.run_fn)}.\n\n"
                f"```sh\ntemporal workflow start --type {defn.name} --task-queue control "
                f"--workflow-id {wf_id} \\\n  --input '{example}'\n```\n\n"
            )
        groups = (("update", defn.updates), ("signal", defn.signals), ("query", defn.queries))
        for kind, handlers in groups:
            for name in sorted(k for k in handlers if k):
                fn = handlers[name].fn
                parts.append(_message(kind, name, fn, wf_id))
                inputs.extend(_types_of(fn))
    parts.append("## Types\n\nInputs and answers, as JSON field by field.\n\n")
    catalog = {"ModelSpec", "EngineProfile", "AdapterSpec", "AutoscalePolicy", "QueuePolicy"}
    for model in models_closure(inputs):
        if model.__name__ in catalog:
            # A catalog entry is a ModelSpec plus its replicas (CatalogModel).
            anchor = "catalogmodel" if model.__name__ == "ModelSpec" else anchor_of(model)
            parts.append(
                f"### {model.__name__}\n\nAs in the catalog: "
                f"[{model.__name__}](catalog.md#{anchor}).\n\n"
            )
            continue
        parts.append(f"### {model.__name__}\n\n{doc_of(model)}\n\n")
        parts.append(model_table(model, field_meaning(model)) + "\n")
    return "".join(parts)
