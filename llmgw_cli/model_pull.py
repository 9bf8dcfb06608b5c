"""``llmgw model pull``: a model's weights fetched to nodes ahead of a deploy,
as the durable ModelPull job (workflows/model_pull.py), its progress shown
as the nodes heartbeat it."""

from datetime import UTC, datetime
from typing import Annotated

import typer

from llmgw import replicas
from llmgw.types.pull import ModelPullInput, ModelPullResult
from llmgw_cli.common import CliSettings, catalog_spec, connect, fail, out, run

POLL_S = 1.0


def model_pull(
    name: str,
    nodes: Annotated[
        str, typer.Option("--nodes", help="comma-separated node ids (default: every live node)")
    ] = "",
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="follow the job until every node is done")
    ] = True,
) -> None:
    """Fetch NAME's weights (and install its engine) on nodes, ahead of a deploy."""
    from workflows.placement import split_live  # noqa: PLC0415

    settings = CliSettings()
    spec = catalog_spec(settings, name)

    async def go() -> ModelPullResult | None:
        client = await connect(settings)
        chosen = [n.strip() for n in nodes.split(",") if n.strip()]
        if not chosen:
            live, _ = split_live(await replicas.fleet_snapshot(client), datetime.now(UTC))
            chosen = sorted(live)
        if not chosen:
            fail("no live node to pull to (llmgw agent on each node registers it)")
        workflow_id = await replicas.start_pull(client, ModelPullInput(model=spec, nodes=chosen))
        out.print(f"pull {workflow_id}: {name} to {', '.join(chosen)}", markup=False)
        if not wait:
            return None
        shown: dict[str, str] = {}
        while (result := await replicas.pull_result(client, workflow_id, POLL_S)) is None:
            for node, detail in sorted((await replicas.pull_progress(client, workflow_id)).items()):
                if shown.get(node) != (line := detail.text()):
                    shown[node] = line
                    out.print(f"  {node}: {line}", markup=False)
        return result

    result = run(go())
    if result is None:
        return
    for node in result.nodes:
        if node.ok:
            how = "already held" if node.cached else "fetched"
            out.print(f"  {node.node_id}: {how}, {node.size_bytes} bytes", markup=False)
        else:
            out.print(f"  {node.node_id}: failed: {node.reason}", markup=False)
    if not all(n.ok for n in result.nodes):
        raise typer.Exit(1)
