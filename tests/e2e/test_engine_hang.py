"""A llama.cpp engine frozen by SIGSTOP (alive, serving nothing): the agent's
liveness probe finds it hung, kills it, and the deployment replaces the
replica; the model serves again through the router.

The agent runs with short liveness settings (LLMGW_LIVENESS_*: rounds of a
fraction of a second); every wait is on a condition."""

import asyncio
import os
import signal

from temporalio.client import Client

from llmgw import replicas
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase, RestartPolicy, ShardRef
from llmgw_cli.dev.tinymodel import TinyModel
from tests.e2e.test_engine_kill import replaced_and_serving
from tests.harness import System
from worker_agent import procfs
from worker_agent.liveness import ENGINE_HUNG
from worker_agent.supervisor import Supervisor

MODEL = "tiny-hang"
NODE = "hang-node"
FAST_LIVENESS = {
    "LLMGW_LIVENESS_INTERVAL_S": "0.5",
    "LLMGW_LIVENESS_TIMEOUT_S": "2",
    "LLMGW_LIVENESS_UNANSWERED_ROUNDS": "3",
    "LLMGW_LIVENESS_UNANSWERED_S": "3",
}


async def test_a_frozen_engine_is_replaced_and_the_model_serves_again(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    key = system.catalog(spec)
    base = (await system.start(client, NODE, agent_env=FAST_LIVENESS)).base
    await replicas.apply_deployment(client, spec, 1, restart=RestartPolicy(initial_backoff_s=0.5))
    first = await replicas.wait_deployment_ready(client, MODEL, 120)
    shard = Supervisor(system.work_dir / "agent" / NODE).find_running(
        ShardRef(replica_id=first.replica_id)
    )
    assert shard is not None

    os.kill(shard.pid, signal.SIGSTOP)  # the process lives; nothing in it runs
    try:
        # Killed, not left stopped: the whole group goes.
        async with asyncio.timeout(120):
            while procfs.group_members(shard.group):
                await asyncio.sleep(0.1)
    finally:
        if procfs.group_members(shard.group):
            os.kill(shard.pid, signal.SIGCONT)
    await replaced_and_serving(client, first, base, key, MODEL, 180)
    old = await replicas.status_of(client, first.replica_id)
    assert old is not None and old.phase is ReplicaPhase.FAILED
    assert old.reason.startswith(f"{ENGINE_HUNG}: its liveness probe went unanswered"), old.reason
    await replicas.remove_deployment(client, spec, 60)
