"""The DrainNode job: cordon, drain, and the deployment replaces elsewhere."""

import asyncio
import subprocess
import sys

from temporalio.client import Client

from llmgw import replicas
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase, RestartPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System
from tests.recording import record

MODEL = "tiny-drain-node"


async def test_drain_node_moves_the_replica_to_another_node(
    system: System, client: Client, tiny: TinyModel
) -> None:
    system.spawn("control")
    for node in ("dn-a", "dn-b"):
        system.spawn_agent(node)
        await replicas.wait_node_registered(client, node, 60)
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    await replicas.apply_deployment(client, spec, 1, restart=RestartPolicy(initial_backoff_s=0.2))
    first = await replicas.wait_deployment_ready(client, MODEL, 120)

    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "llmgw_cli", "node", "drain", first.node_id, "--timeout", "60"],
        env=system.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"drained {first.replica_id}" in result.stderr

    moved = await replicas.wait_deployment_ready(client, MODEL, 120)
    assert moved.replica_id != first.replica_id
    assert moved.node_id != first.node_id
    gone = await replicas.status_of(client, first.replica_id)
    assert gone is not None and gone.phase is ReplicaPhase.STOPPED
    assert first.node_id in (await replicas.fleet_snapshot(client)).cordoned

    # The job is listed by node and state (what the Temporal UI filters on).
    query = (
        f"WorkflowType = 'DrainNode' AND ReplicaNode = '{first.node_id}'"
        " AND ReplicaState = 'drained'"
    )
    async with asyncio.timeout(30):
        while not (jobs := [wf.id async for wf in client.list_workflows(query)]):
            await asyncio.sleep(0.2)
    [job] = jobs
    await record(client, job, "drain_node")
    snap = await replicas.cordon(client, first.node_id, cordoned=False)
    assert snap.cordoned == []
    await replicas.remove_deployment(client, spec, 60)
