"""SIGKILL of a llama.cpp engine's leader: the agent notices, kills what is left of its
process group (the pass-through), and the deployment replaces the replica."""

import asyncio
import os
import signal

import openai
from temporalio.client import Client

from llmgw import replicas
from llmgw.types import EngineKind, ModelSpec, ReplicaMemo, ReplicaPhase, RestartPolicy, ShardRef
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, wait_routable
from worker_agent import procfs
from worker_agent.supervisor import Supervisor

MODEL = "tiny-kill"
NODE = "kill-node"


async def test_sigkilled_engine_leaves_nothing_and_its_replica_is_replaced(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    key = system.catalog(spec)
    base = (await system.start(client, NODE)).base
    await replicas.apply_deployment(client, spec, 1, restart=RestartPolicy(initial_backoff_s=0.5))
    first = await replicas.wait_deployment_ready(client, MODEL, 120)
    shard = Supervisor(system.work_dir / "agent" / NODE).find_running(
        ShardRef(replica_id=first.replica_id)
    )
    assert shard is not None
    assert len(procfs.group_members(shard.group)) == 2, "pass-through and llama-server"

    os.kill(shard.pid, signal.SIGKILL)
    async with asyncio.timeout(30):
        while procfs.group_members(shard.group):
            await asyncio.sleep(0.1)
    old = await replaced_and_serving(client, first, base, key, MODEL)
    assert old.phase is ReplicaPhase.FAILED
    await replicas.remove_deployment(client, spec, 60)


async def replaced_and_serving(
    client: Client, first: ReplicaMemo, base: str, key: str, model: str, timeout_s: float = 120
) -> ReplicaMemo:
    """Once the deployment of ``model`` has a ready replica other than
    ``first`` and the router serves a completion of it: ``first``'s memo now."""
    async with asyncio.timeout(timeout_s):
        while (
            memo := await replicas.wait_deployment_ready(client, model, timeout_s)
        ).replica_id == (first.replica_id):
            await asyncio.sleep(0.2)
    assert memo.phase is ReplicaPhase.READY
    await wait_routable(base, key, model)
    async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as oai:
        # The router may still hold the dead replica for one refresh: it fails over.
        resp = await oai.completions.create(model=model, prompt="hi", max_tokens=3)
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    old = await replicas.replica_memo(client, first.replica_id)
    assert old is not None
    return old
