"""The settings page (reference/settings.md): every ``BaseSettings`` class in
the packages (found in the source) as ``LLMGW_*`` variables, and the
``LLMGW_*`` names read outside them.
"""

import ast
import importlib

from refgen.common import (
    PACKAGES,
    ROOT,
    bounds_of,
    cell,
    default_text,
    doc_of,
    module_of,
    nested_models,
    sources,
    type_name,
)
from refgen.meanings import field_meaning


def _settings_modules() -> list[str]:
    """Modules with a class derived from BaseSettings, directly or through
    another such class (``class CliSettings(_Common)``)."""
    classes: list[tuple[str, str, list[str]]] = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                classes.append((module_of(path), node.name, bases))
    names = {"BaseSettings"}
    grew = True
    while grew:
        found = {name for _, name, bases in classes if names.intersection(bases)}
        grew = not found <= names
        names |= found
    return sorted({module for module, name, _ in classes if name in names})


def _all_settings() -> list[type]:
    from pydantic_settings import BaseSettings  # noqa: PLC0415

    for module in _settings_modules():
        importlib.import_module(module)
    out: list[type] = []
    todo: list[type] = [BaseSettings]
    sub: type
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.split(".")[0] in PACKAGES and sub not in out:
                out.append(sub)
    return out


def _env_rows(cls: type, names: list[str], prefix: str) -> list[str]:
    meaning = field_meaning(cls)
    rows = []
    for name in names:
        field = cls.model_fields[name]  # type: ignore[attr-defined]
        nested = list(nested_models(field.annotation))
        if nested:
            rows += _env_rows(nested[0], list(nested[0].model_fields), f"{prefix}{name.upper()}__")
            continue
        kind = type_name(field.annotation)
        bounds = bounds_of(field)
        kind += f" ({bounds})" if bounds else ""
        rows.append(
            f"| `{prefix}{name.upper()}` | {cell(kind)} | {cell(default_text(field))} "
            f"| {cell(meaning(name, field))} |"
        )
    return rows


_OTHER_ENV = {
    "LLMGW_LLAMA_CPP": "which llama.cpp build the agent installs: `auto` (default), "
    "`portable` (the xllamacpp wheel) or `build` (from source); see Engines",
    "LLMGW_STORE_MIGRATE_TO": "`llmgw store migrate --to`",
    "LLMGW_API_KEY": "`llmgw bench --api-key`",
    "LLMGW_ENGINE_KEY": "`llmgw bench`: an engine key, for a run straight at a replica",
    "LLMGW_PASSTHROUGH_KEY": "internal: set by the agent for an engine's pass-through",
    "LLMGW_SGLANG_API_KEY": "internal: set by the agent for SGLang's key shim",
    "LLMGW_ENGINE_OF": "internal: marks an engine's environment with its shard",
    "LLMGW_DROP_TO": "internal: the user a pass-through started as root becomes",
}


def _other_env(known: set[str]) -> list[str]:
    rows = []
    seen: set[str] = set()
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            name = node.value
            if (
                name.startswith("LLMGW_")
                and name.rstrip("_") == name
                and name.replace("_", "").isalnum()
                and name.isupper()
                and name not in known
                and name not in seen
                and not any(name.startswith(k + "_") for k in known if k.endswith("_TLS"))
            ):
                seen.add(name)
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                rows.append(f"| `{name}` | `{where}` | {cell(_OTHER_ENV.get(name, ''))} |")
    return sorted(rows)


def settings_page() -> str:
    classes = _all_settings()
    parts = [
        "# Settings\n\n",
        "Every process reads its settings from `LLMGW_*` environment variables, through the "
        "pydantic-settings classes listed here (found in the source: every class derived from "
        "`BaseSettings`). A nested block is set with `__`, as in "
        "`LLMGW_TRACING__EXPORTER=otlp`. Each entry point builds its own settings object; "
        "nothing else reads the environment, except the few names at the end.\n\n",
    ]
    known: set[str] = set()
    shown: set[tuple[type, str]] = set()
    for cls in classes:
        own = [
            n
            for n in cls.model_fields  # type: ignore[attr-defined]
            if not any((base, n) in shown for base in cls.__mro__[1:] if base in classes)
        ]
        shown.update((cls, n) for n in cls.model_fields)  # type: ignore[attr-defined]
        rows = _env_rows(cls, own, "LLMGW_")
        known.update(r.split("`")[1] for r in rows)
        title = cls.__name__ if not cls.__name__.startswith("_") else "Every process"
        inherits = [b.__name__ for b in cls.__mro__[1:] if b in classes]
        parts.append(f"## {title}\n\n`{cls.__module__}.{cls.__name__}`. {doc_of(cls)}\n\n")
        if inherits:
            parts.append("Also every setting of [Every process](#every-process).\n\n")
        if rows:
            parts.append("| variable | type | default | meaning |\n|---|---|---|---|\n")
            parts.append("\n".join(rows) + "\n\n")
    parts.append(
        "## Read outside the settings classes\n\n"
        "`LLMGW_*` names that the code reads or sets directly (found in the source). "
        "Those marked internal are set by llmgw for its own child processes.\n\n"
        "| variable | where | meaning |\n|---|---|---|\n"
    )
    parts.append("\n".join(_other_env(known)) + "\n")
    return "".join(parts)
