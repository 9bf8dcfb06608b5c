"""``llmgw agent`` (run it, or show this node's inventory) and ``llmgw node``
(drain, uncordon, setup): the commands about one node, registered in
``llmgw_cli.app``."""

from typing import Annotated

import typer
from rich.table import Table

from llmgw import replicas
from llmgw.errors import LlmgwError
from llmgw_cli.common import CliSettings, console, out
from llmgw_cli.common import connect as _connect
from llmgw_cli.common import fail as _fail
from llmgw_cli.common import run as _run

agent_app = typer.Typer(help="The node agent (task queue node-<id>)")
node_app = typer.Typer(help="Node preparation", no_args_is_help=True)


@agent_app.callback(invoke_without_command=True)
def agent(ctx: typer.Context) -> None:
    """Run the node agent for this machine (task queue ``node-<id>``)."""
    if ctx.invoked_subcommand is None:
        from llmgw_cli.agent import main  # noqa: PLC0415

        main()


@agent_app.command("inventory")
def agent_inventory(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """What the scheduler would see for this node."""
    from llmgw.settings import AgentSettings  # noqa: PLC0415
    from worker_agent.installs.installed import installed_engines  # noqa: PLC0415
    from worker_agent.installs.llamacpp import find_llama_cpp  # noqa: PLC0415
    from worker_agent.inventory import engine_capabilities, sources_from  # noqa: PLC0415
    from worker_agent.main import inventory  # noqa: PLC0415
    from worker_agent.supervisor import Supervisor  # noqa: PLC0415

    settings = AgentSettings()
    shards = Supervisor(settings.work_dir / "agent" / settings.node_id, settings.node_id)
    inv = inventory(settings, shards, sources_from(settings.sys_root, settings.gpu_snapshot))
    inv.engines = installed_engines(settings.resolved_engine_cache_dir())
    inv.capabilities = engine_capabilities(find_llama_cpp(settings.resolved_engine_cache_dir()))
    if as_json:
        out.print_json(inv.model_dump_json())
        return
    out.print(
        f"node [bold]{inv.node_id}[/bold] ({inv.hostname}): {inv.cpu_count} CPUs, "
        f"{inv.memory_mib} MiB, engines reached at {inv.address}"
    )
    out.print(f"GPUs: {inv.gpu_discovery}")
    if inv.gpus:
        table = Table("index", "name", "class", "memory MiB", "CC", "PCI", "health")
        for g in inv.gpus:
            health = "ok" if g.healthy else f"[red]{g.health_detail}[/red]"
            table.add_row(
                str(g.index), g.name, g.gpu_class, str(g.memory_mib),
                g.compute_capability, g.pci_bus_id, health,
            )  # fmt: skip
        out.print(table)
    fab = inv.fabric
    out.print(
        f"fabric: {fab.kind.value} (island {fab.island}); management interface "
        f"{fab.management_interface or 'unknown'} ({fab.management_address or '-'})"
    )
    if fab.ports:
        ports = Table("device", "port", "state", "rate Gb/s", "link", "netdev", "RoCE v2 GID")
        for p in fab.ports:
            gid = "-" if p.roce_v2_ipv4_gid_index is None else str(p.roce_v2_ipv4_gid_index)
            ports.add_row(
                p.device, str(p.port), p.state, f"{p.rate_gbps:g}",
                p.link_layer.value, p.netdev or "-", gid,
            )  # fmt: skip
        out.print(ports)
    for engine in inv.engines:
        out.print(f"engine: {engine.engine} ({engine.package}=={engine.version}) at {engine.path}")
    out.print(f"capabilities: {', '.join(inv.capabilities or []) or 'none beyond one node'}")
    if inv.weights is not None:
        walked = "" if inv.weights.complete else " (more than are reported)"
        out.print(f"weights roots: {', '.join(inv.weights.roots) or 'none'}{walked}")
        for refused in inv.weights.refused:
            out.print(f"  refused as a source: {refused.path}: {refused.problem}")
    for shard in inv.running:
        out.print(f"running: {shard.replica_id} rank {shard.rank} pid {shard.pid} {shard.endpoint}")


@node_app.command("drain")
def node_drain(
    node_id: str,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the replicas")] = 1800.0,
) -> None:
    """Cordon a node, then drain its replicas (deployments replace them elsewhere)."""
    settings = CliSettings()

    async def go() -> None:
        client = await _connect(settings)
        with console.status(f"draining {node_id}"):
            result = await replicas.drain_node(client, node_id, timeout)
        console.print(f"{node_id}: cordoned; drained {', '.join(result.drained) or 'nothing'}")
        if result.remaining:
            _fail(f"still on {node_id} after {timeout:.0f}s: {', '.join(result.remaining)}")

    _run(go())


@node_app.command("uncordon")
def node_uncordon(node_id: str) -> None:
    """Offer a cordoned node to new replicas again."""
    settings = CliSettings()

    async def go() -> None:
        client = await _connect(settings)
        snap = await replicas.cordon(client, node_id, cordoned=False)
        console.print(f"{node_id}: uncordoned (cordoned now: {', '.join(snap.cordoned) or 'none'})")

    _run(go())


@node_app.command("setup")
def node_setup() -> None:
    """Create the llmgw-engine user (in the video and render groups). Needs root."""
    from worker_agent.users import setup_node  # noqa: PLC0415

    try:
        for line in setup_node():
            console.print(line)
    except (OSError, RuntimeError, LlmgwError) as exc:
        _fail(f"node setup failed: {exc}")
