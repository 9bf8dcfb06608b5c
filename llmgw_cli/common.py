"""What every ``llmgw`` command shares: settings, consoles, failing with a message."""

from typing import NoReturn

import typer
from rich.console import Console

from llmgw.settings import _Common

console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


class CliSettings(_Common):
    """Settings of one-shot CLI commands (same LLMGW_* variables)."""


def fail(message: str) -> NoReturn:
    """Print ``message`` as an error and exit 1."""
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)
