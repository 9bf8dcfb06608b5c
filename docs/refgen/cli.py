"""The CLI page (reference/cli.md): every ``llmgw`` command, from the typer
app of ``llmgw_cli/app.py``.
"""

import enum
import inspect
from collections.abc import Iterator
from typing import Any

from refgen.common import cell, type_name


def _commands(group: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    for name in sorted(group.commands):
        command = group.commands[name]
        if getattr(command, "hidden", False):
            continue
        if hasattr(command, "commands"):
            if command.callback is not None:  # `llmgw agent` runs, and has subcommands
                yield [*path, name], command
            yield from _commands(command, [*path, name])
        else:
            yield [*path, name], command


def _param_type(param: Any) -> str:
    # typer >= 0.16 carries the annotation; plain click parameters a ParamType.
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None:
        return type_name(descriptor.annotation)
    return str(getattr(getattr(param, "type", None), "name", ""))


def _param_row(param: Any) -> str:
    if param.param_type_name == "argument":
        names = f"`{param.name.upper()}`"
    else:
        names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    default = param.default
    if callable(default) or default is None or default in ((), ""):
        default = ""
    elif isinstance(default, enum.Enum):
        default = default.value
    envvar = f" (env `{param.envvar}`)" if getattr(param, "envvar", None) else ""
    required = " **required**" if param.required else ""
    help_text = getattr(param, "help", "") or ""
    return (
        f"| {names} | {cell(_param_type(param))}{required} | {cell(default)} "
        f"| {cell(help_text)}{envvar} |"
    )


def _usage(path: list[str], command: Any) -> str:
    words = ["llmgw", *path]
    if any(p.param_type_name == "option" for p in command.params):
        words.append("[OPTIONS]")
    for p in command.params:
        if p.param_type_name == "argument":
            words.append(p.name.upper() if p.required else f"[{p.name.upper()}]")
    return " ".join(words)


def cli_page() -> str:
    import typer  # noqa: PLC0415

    from llmgw_cli.app import app  # noqa: PLC0415

    commands = list(_commands(typer.main.get_command(app), []))
    parts = [
        "# CLI\n\n",
        "Every `llmgw` command, read from the typer app (`llmgw_cli/app.py`). "
        "`llmgw COMMAND --help` prints the same.\n\n",
        "| command | what |\n|---|---|\n",
    ]
    for path, command in commands:
        anchor = "llmgw-" + "-".join(path)
        summary = inspect.cleandoc(command.help or "").split("\n\n")[0]
        parts.append(f"| [`llmgw {' '.join(path)}`](#{anchor}) | {cell(summary)} |\n")
    for path, command in commands:
        parts.append(f"\n## llmgw {' '.join(path)}\n\n```\n{_usage(path, command)}\n```\n\n")
        parts.append(inspect.cleandoc(command.help or "") + "\n\n")
        if command.params:
            parts.append("| argument / option | type | default | meaning |\n|---|---|---|---|\n")
            parts.append("\n".join(_param_row(p) for p in command.params) + "\n")
    return "".join(parts)
