"""The ``llmgw bench`` command: progress on stderr, a table or JSON on stdout."""

import asyncio
import os
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmgw_cli.bench import BenchConfig, BenchResult, run_bench

ENGINE_KEY_ENV = "LLMGW_ENGINE_KEY"


def _table(result: BenchResult) -> Table:
    table = Table(title=f"llmgw bench: {result.model} at {result.target}")
    table.add_column("measure")
    table.add_column("value", justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    rows = [
        ("requests (errors)", f"{result.requests} ({result.errors})"),
        ("concurrency", str(result.concurrency)),
        ("duration", f"{result.duration_s:.2f} s"),
        ("requests/s", f"{result.requests_per_s:.2f}"),
        ("latency p50 / p99", f"{ms(result.latency_p50_ms)} / {ms(result.latency_p99_ms)}"),
        ("TTFT p50 / p99", f"{ms(result.ttft_p50_ms)} / {ms(result.ttft_p99_ms)}"),
        ("inter-token p50 / p99", f"{ms(result.itl_p50_ms)} / {ms(result.itl_p99_ms)}"),
        ("output tokens/s", f"{result.output_tokens_per_s:.1f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for error in result.first_errors:
        table.add_row("error", error)
    return table


def _engine_of(gateway_url: str, replica: str, admin_key: str) -> tuple[str, str]:
    """The replica's engine base URL and key, from the gateway's admin API."""
    if not admin_key:
        raise typer.BadParameter("--replica needs --admin-key or $LLMGW_ADMIN_KEY")
    root = gateway_url.rstrip("/").removesuffix("/v1")
    resp = httpx.get(
        f"{root}/admin/replicas/{replica}/engine-key",
        headers={"Authorization": f"Bearer {admin_key}"},
        timeout=10,
    )
    if resp.status_code != 200:
        raise typer.BadParameter(f"admin API: {resp.status_code} {resp.text[:200]}")
    data = resp.json()
    return f"{data['endpoint']}/v1", str(data["engine_key"])


def bench(
    model: Annotated[str, typer.Option(help="the model id to ask for")],
    url: Annotated[
        str, typer.Option(help="OpenAI base URL (the gateway's, or an engine's /v1)")
    ] = "http://127.0.0.1:8000/v1",
    api_key: Annotated[
        str, typer.Option(envvar="LLMGW_API_KEY", help="client API key for the gateway")
    ] = "",
    engine: Annotated[
        bool, typer.Option(help=f"aim at one engine; its key from ${ENGINE_KEY_ENV}")
    ] = False,
    replica: Annotated[
        str,
        typer.Option(
            help="aim straight at this replica's engine (endpoint and key from the admin API)"
        ),
    ] = "",
    admin_key: Annotated[
        str, typer.Option(envvar="LLMGW_ADMIN_KEY", help="admin credential, for --replica")
    ] = "",
    concurrency: Annotated[int, typer.Option(min=1)] = 4,
    requests: Annotated[int | None, typer.Option(min=1, help="stop after this many")] = None,
    duration: Annotated[
        float | None, typer.Option(min=0.1, help="or after this many seconds")
    ] = None,
    prompt_tokens: Annotated[int, typer.Option(min=1)] = 32,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    stream: Annotated[bool, typer.Option(help="streamed answers (TTFT, inter-token)")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the figures as JSON")] = False,
) -> None:
    """Load the gateway (or one engine) and print requests/s, TTFT, inter-token latency."""
    if replica:
        url, key = _engine_of(url, replica, admin_key)
    else:
        key = os.environ.get(ENGINE_KEY_ENV, "") if engine else api_key
    if not key:
        raise typer.BadParameter(
            f"set ${ENGINE_KEY_ENV} (from the admin API)"
            if engine
            else "--api-key or $LLMGW_API_KEY"
        )
    config = BenchConfig(
        base_url=url, key=key, model=model, concurrency=concurrency, requests=requests,
        duration_s=duration, prompt_tokens=prompt_tokens, max_tokens=max_tokens, stream=stream,
    )  # fmt: skip
    err = Console(stderr=True)
    total = requests if requests is not None else (None if duration else 100)
    counts = TextColumn("{task.completed} done, {task.fields[errors]} errors")
    columns = (TextColumn("[bold]bench"), BarColumn(), counts, TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("bench", total=total, errors=0)
        result = asyncio.run(
            run_bench(
                config, lambda done, errors: progress.update(task, completed=done, errors=errors)
            )
        )
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        Console().print(_table(result))
    if result.errors == result.requests:
        raise typer.Exit(1)
