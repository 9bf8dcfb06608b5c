"""The ``llmgw`` command line."""

import asyncio
import os
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from temporalio.service import RPCError

from llmgw import replicas
from llmgw.errors import LlmgwError
from llmgw.settings import UpSettings
from llmgw.types import DeploymentStatus, ReplicaMemo, ReplicaPhase
from llmgw_cli.batches import batches_app
from llmgw_cli.bench_command import bench
from llmgw_cli.common import CliSettings, catalog_spec, console, out, tracings
from llmgw_cli.common import connect as _connect
from llmgw_cli.common import fail as _fail
from llmgw_cli.common import run as _run
from llmgw_cli.elastic import (
    autoscale_lines,
    deployment_or_none,
    deployments,
    deployments_table,
    scale,
)
from llmgw_cli.keys import keys_app
from llmgw_cli.model import model_app
from llmgw_cli.model_pull import model_pull
from llmgw_cli.nodes import agent_app, node_app
from llmgw_cli.output import (
    DeploymentRow,
    ExplainDeployment,
    ExplainOutput,
    NodeReason,
    NodeRow,
    Preemption,
    ReplicaRow,
    ShardRow,
    SharedNode,
    StatusOutput,
    print_json,
)
from llmgw_cli.store_copy import migrate_store

if TYPE_CHECKING:
    from temporalio.client import Client

# Every command and sub-app is registered here, and only here: the modules
# that define them import what they share from ``common``, never this one.
app = typer.Typer(
    help="llmgw: LLM inference control plane and OpenAI gateway", no_args_is_help=True
)
app.command()(bench)
app.command()(scale)
app.add_typer(keys_app, name="keys")
app.add_typer(batches_app, name="batches")

_JSON_HELP = "print JSON (docs: CLI JSON output)"


@app.command()
def up(
    router_port: Annotated[int | None, typer.Option(help="router port")] = None,
    temporal_port: Annotated[int | None, typer.Option(help="Temporal gRPC port")] = None,
    ui_port: Annotated[int | None, typer.Option(help="Temporal web UI port")] = None,
) -> None:
    """Run the whole system on this machine and serve the default model."""
    from llmgw_cli.up import run_up  # noqa: PLC0415 - heavy imports only for this command

    overrides = {
        k: v
        for k, v in {
            "router_port": router_port,
            "temporal_port": temporal_port,
            "ui_port": ui_port,
        }.items()
        if v is not None
    }
    settings = UpSettings().model_copy(update=overrides)

    def say(line: str) -> None:
        console.print(f"[dim]llmgw up:[/dim] {line}")

    def announce(endpoint: str, ui: str, key: str) -> None:
        out.print(
            f"\n[bold green]llmgw is serving[/bold green]\n"
            f"  OpenAI endpoint : {endpoint}\n"
            f"  Temporal UI     : {ui}\n"
            f"  API key         : {key}  (also in {settings.work_dir}/dev-api-key)\n"
            f"  Ctrl-C stops everything.\n"
        )
        out.file.flush()

    try:
        asyncio.run(run_up(settings, say, announce))
    except LlmgwError as exc:
        _fail(str(exc))


@app.command()
def control() -> None:
    """Run the control-plane worker (task queue ``control``)."""
    from workflows.worker import main  # noqa: PLC0415

    main()


app.add_typer(agent_app, name="agent")
app.add_typer(node_app, name="node")
model_app.command("pull")(model_pull)
app.add_typer(model_app, name="model")


@app.command()
def explain(
    model: str, as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False
) -> None:
    """Where a new replica of MODEL would go, or why it cannot be placed."""
    from workflows.placement import choose_node, sharing, split_live  # noqa: PLC0415
    from workflows.preemption import claims, plan_preemption  # noqa: PLC0415

    settings = CliSettings()
    spec = catalog_spec(settings, model)

    async def go() -> tuple[ExplainOutput, DeploymentStatus | None]:
        client = await _connect(settings)
        fleet = await replicas.fleet_snapshot(client)
        live, down = split_live(fleet, datetime.now(UTC))
        held = claims(fleet.allocations, fleet.reservations)
        result = choose_node("explain", spec, live, held)
        placement = preemption = None
        if result.placement is not None:
            placement = [
                ShardRow(rank=s.rank, node_id=s.node_id) for s in result.placement.shards()
            ]
        elif plan := plan_preemption("explain", spec, live, fleet.allocations, fleet.reservations):
            preemption = Preemption(
                priority=spec.priority,
                victims=plan.victims,
                nodes=sorted({s.node_id for s in plan.placement.shards()}),
            )
        status = await deployment_or_none(client, model)
        found = ExplainOutput(
            model=model,
            placement=placement,
            preemption=preemption,
            rejections=[
                NodeReason(node_id=r.node_id, reason=r.reason) for r in [*result.rejections, *down]
            ],
            shared=[
                SharedNode(
                    node_id=s.node_id,
                    replicas=s.replicas,
                    new_replica=s.new_replica,
                    reason=s.reason,
                )
                for s in sharing(spec, live, held, down, result)
            ],
            deployment=None if status is None else ExplainDeployment.of(status),
            fetching=[
                await _row(client, m)
                for m in await replicas.list_replicas(client)
                if m.model == model and m.phase is ReplicaPhase.FETCHING
            ],
        )
        return found, status

    found, status = _run(go())
    if as_json:
        print_json(found)
        return
    if found.placement is not None:
        nodes = ", ".join(f"rank {s.rank} on {s.node_id}" for s in found.placement)
        out.print(f"{model}: a new replica would be placed: {nodes}")
    elif (plan := found.preemption) is not None:
        out.print(
            f"{model}: no free room; priority {plan.priority} would preempt "
            f"{', '.join(plan.victims)} on {', '.join(plan.nodes)}"
        )
    else:
        out.print(f"{model}: no placement")
    for rejection in found.rejections:
        out.print(f"  {rejection.node_id}: {rejection.reason}")
    for shared in found.shared:
        out.print(shared.line(model), markup=False)
    for row in found.fetching:
        out.print(f"{row.replica_id} on {row.node_id}: {'; '.join(row.progress) or 'fetching'}")
    for line in autoscale_lines(model, status):
        out.print(line, markup=False)


@app.command()
def logs(
    replica_id: str,
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, max=2000)] = 100,
) -> None:
    """The last lines a replica's engine wrote, fetched from its node."""
    settings = CliSettings()

    async def go() -> list[str]:
        client = await _connect(settings)
        return await replicas.log_tail(client, replica_id, lines)

    for line in _run(go()):
        out.print(line, markup=False, highlight=False)


@app.command()
def router() -> None:
    """Run the OpenAI-compatible router."""
    from router.main import main  # noqa: PLC0415

    main()


@app.command()
def deploy(
    model: str,
    replicas_: Annotated[
        int, typer.Option("--replicas", "-n", min=1, help="how many replicas")
    ] = 1,
    wait: Annotated[bool, typer.Option(help="wait until ready, showing progress")] = True,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 600.0,
) -> None:
    """Start replicas of a catalog model."""
    settings = CliSettings()
    spec = catalog_spec(settings, model)

    async def go() -> None:
        client = await _connect(settings)
        ids = [await replicas.start_replica(client, spec) for _ in range(replicas_)]
        for rid in ids:
            console.print(f"started replica [bold]{rid}[/bold] (workflow replica/{rid})")
        if not wait:
            return
        with console.status("waiting for replicas") as status:

            def show(memo: ReplicaMemo) -> None:
                status.update(f"{memo.replica_id}: {memo.phase} {memo.node_id}")
                console.print(f"  {memo.replica_id}: {memo.phase} {memo.node_id}")

            await asyncio.gather(*(replicas.wait_ready(client, r, timeout, show) for r in ids))
        console.print("[green]ready[/green]")

    _run(go())


@app.command()
def restart(model: str) -> None:
    """Rolling restart of the model's deployment: start new, wait ready, drain old."""
    settings = CliSettings()

    async def go() -> None:
        client = await _connect(settings)
        status = await replicas.rolling_restart(client, model, "llmgw restart")
        console.print(f"deployment/{model}: replacing slots {status.rolling or 'none'}")

    _run(go())


@app.command()
def status(
    all_: Annotated[bool, typer.Option("--all", help="include stopped replicas")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Replicas and their states, read from Temporal."""
    settings = CliSettings()

    async def go() -> tuple[list[ReplicaRow], list[DeploymentStatus], list[NodeRow]]:
        client = await _connect(settings)
        memos = await replicas.list_replicas(client, include_closed=all_)
        rows = [await _row(client, m) for m in memos]
        return rows, await deployments(client), await _node_rows(client)

    rows, found, nodes = _run(go())
    if as_json:
        print_json(
            StatusOutput(
                replicas=rows,
                deployments=[DeploymentRow.of(d) for d in sorted(found, key=lambda d: d.model)],
                nodes=nodes,
            )
        )
        return
    table = Table("replica", "model", "state", "node", "endpoint")
    for r in rows:
        state = "; ".join([r.phase, *r.progress])
        table.add_row(r.replica_id, r.model, state, r.node_id, r.endpoint)
    out.print(table)
    if found:
        out.print(deployments_table(found))
    if nodes:
        node_table = Table("node", "address", "peer", "state")
        for n in nodes:
            node_table.add_row(n.node_id, n.address, n.peer_url or "-", n.state)
        out.print(node_table)


async def _node_rows(client: "Client") -> list[NodeRow]:
    """Every registered node with its addresses; none when the fleet does not
    answer (no node registered yet, or no control worker)."""
    from workflows.placement import split_live  # noqa: PLC0415

    try:
        fleet = await replicas.fleet_snapshot(client)
    except RPCError:
        return []
    _, down = split_live(fleet, datetime.now(UTC))
    why = {r.node_id: r.reason for r in down}
    return [
        NodeRow(
            node_id=n.node_id,
            hostname=n.hostname,
            address=n.address,
            peer_url=n.peer_url,
            state=why.get(n.node_id, "up"),
        )
        for n in sorted(fleet.nodes.values(), key=lambda n: n.node_id)
    ]


async def _row(client: "Client", memo: ReplicaMemo) -> ReplicaRow:
    """A replica's status row; a fetching one's with its fetches' progress."""
    if memo.phase is not ReplicaPhase.FETCHING:
        return ReplicaRow.of(memo)
    found = await replicas.fetch_progress(client, memo.replica_id)
    return ReplicaRow.of(memo, [p.text() for p in found])


@app.command()
def stop(replica_id: str, timeout: float = 60.0) -> None:
    """Drain and stop one replica."""
    settings = CliSettings()

    async def go() -> None:
        client = await _connect(settings)
        final = await replicas.stop_replica(client, replica_id, "llmgw stop", timeout)
        console.print(f"{replica_id}: {final.phase}")

    _run(go())


store_app = typer.Typer(help="The store: SQLite or PostgreSQL", no_args_is_help=True)
app.add_typer(store_app, name="store")


@store_app.command("migrate")
def store_migrate(
    to: Annotated[
        str,
        typer.Option(
            "--to",
            envvar="LLMGW_STORE_MIGRATE_TO",
            help="the new, empty store, e.g. postgresql://llmgw@db/llmgw"
            " (password in PGPASSWORD or ~/.pgpass, not in the URL)",
        ),
    ],
) -> None:
    """Copy the whole store (catalog, keys, engine-key secret) into an empty one."""
    settings = CliSettings()
    try:
        migrate_store(settings.resolved_store_url(), to, lambda line: out.print(line, markup=False))
    except LlmgwError as exc:
        _fail(str(exc))
    out.print("now set LLMGW_STORE_URL to the new store and restart every llmgw process")


def main() -> None:
    """The ``llmgw`` entry point.

    Ends with ``os._exit`` once output is flushed: a process that held a
    Temporal client can abort while the interpreter finalises (the SDK's
    runtime threads outlive it; sdk-python#300), turning a successful
    command into a crash.
    """
    code: int = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        console.print_exception()
        code = 1
    for tracing in tracings:
        tracing.shutdown()  # os._exit skips atexit: flush the command's spans here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
