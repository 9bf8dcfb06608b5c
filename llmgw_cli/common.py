"""What every ``llmgw`` command shares: settings, consoles, failing with a
message, the Temporal client of one command and running its async part.

Commands in other modules (``elastic``, ``model``, ``keys``) import these
from here, never from ``app``: ``app`` only registers them.
"""

import asyncio
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from temporalio.client import Client

from llmgw.errors import LlmgwError
from llmgw.settings import _Common
from llmgw.store import Store
from llmgw.temporal import connect_with
from llmgw.tracing import Tracing, setup_tracing
from llmgw.types import ModelSpec

console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

T = TypeVar("T")


class CliSettings(_Common):
    """Settings of one-shot CLI commands (same LLMGW_* variables)."""


def fail(message: str) -> NoReturn:
    """Print ``message`` as an error and exit 1."""
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


# The command's tracing, set up by its first connect; ``app.main`` flushes it.
tracings: list[Tracing] = []


async def connect(settings: _Common) -> Client:
    """A client for one command; traced when the settings say so, so that a
    job started here is one trace with the workflows and node activities."""
    if not tracings:
        tracings.append(setup_tracing(settings.tracing, "cli"))
    return await connect_with(settings, tracings[0].interceptors())


def run(work: Coroutine[Any, Any, T]) -> T:
    """Run a command's async part; llmgw errors become a one-line message."""
    try:
        return asyncio.run(work)
    except LlmgwError as exc:
        fail(str(exc))


def open_store(settings: _Common) -> Store:
    """The store, migrated."""
    store = Store(settings.resolved_store_url())
    store.migrate()
    return store


def catalog_spec(settings: _Common, model: str) -> ModelSpec:
    """The catalog entry of ``model``, or exit naming what the catalog has."""
    store = open_store(settings)
    spec = store.get_model(model)
    if spec is None:
        have = ", ".join(store.model_names()) or "none"
        fail(f"model {model!r} is not in the catalog (have: {have})")
    return spec
