"""What every ``llmgw`` command shares: settings, consoles, failing with a
message, the Temporal client of one command and running its async part.

Commands in other modules (``elastic``, ``model``, ``keys``) import these
from here, never from ``app``: ``app`` only registers them.
"""

import asyncio
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

import typer
from pydantic import Field
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

    # How long a command waits for a Temporal server that is starting, frozen
    # or restarting before it gives up: an operator's command in a short
    # control-plane outage then completes instead of failing half-way.
    temporal_wait_s: float = Field(default=120.0, ge=0)


def fail(message: str) -> NoReturn:
    """Print ``message`` as an error and exit 1."""
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


# The command's tracing, set up by its first connect; ``app.main`` flushes it.
tracings: list[Tracing] = []


async def connect(settings: CliSettings, patient: bool = True) -> Client:
    """A client for one command; traced when the settings say so, so that a
    job started here is one trace with the workflows and node activities.

    A server that does not answer yet is waited for (``temporal_wait_s``),
    the operator told so on stderr at once. Not ``patient``: the caller
    bounds the wait itself and says what it did without Temporal."""
    if not tracings:
        tracings.append(setup_tracing(settings.tracing, "cli"))
    if not patient:
        return await connect_with(settings, tracings[0].interceptors())
    wait_s = settings.temporal_wait_s

    def waiting(reason: str) -> None:
        console.print(
            f"Temporal at {settings.temporal_address} is not answering ({_short(reason)});"
            f" waiting up to {wait_s:g} s (LLMGW_TEMPORAL_WAIT_S), Ctrl-C to give up"
        )

    return await connect_with(settings, tracings[0].interceptors(), wait_s, waiting=waiting)


def _short(reason: str) -> str:
    """The Rust client's reason without its nested source chain."""
    return reason.split(", source:", 1)[0].split("Status {", 1)[-1].strip(" {}")


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
