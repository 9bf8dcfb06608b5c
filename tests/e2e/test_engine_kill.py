"""SIGKILL of a llama.cpp engine's leader: the agent notices, kills what is left of its
process group (the pass-through), and the deployment replaces the replica."""

import asyncio
import os
import signal

import openai
from temporalio.client import Client

from llmgw import replicas
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase, RestartPolicy, ShardRef
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
    async with asyncio.timeout(120):
        while (memo := await replicas.wait_deployment_ready(client, MODEL, 120)).replica_id == (
            first.replica_id
        ):
            await asyncio.sleep(0.2)
    old = await replicas.replica_memo(client, first.replica_id)
    assert old is not None and old.phase is ReplicaPhase.FAILED
    await wait_routable(base, key, MODEL)
    async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as oai:
        # The router may still hold the dead replica for one refresh: it fails over.
        resp = await oai.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    assert memo.phase is ReplicaPhase.READY
    await replicas.remove_deployment(client, spec, 60)
