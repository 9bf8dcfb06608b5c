"""SIGKILL the agent while two engines serve; a new agent adopts both."""

import asyncio
import signal

import openai
from temporalio.client import Client

from llmgw import replicas
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase
from llmgw_cli.dev.tinymodel import TinyModel
from tests.conftest import LlamaPath
from tests.harness import System, wait_routable
from tests.procs_util import engine_pids

MODEL = "tiny-adopt"


async def _reported_pids(client: Client, node: str, expected: list[int]) -> list[int]:
    """The engine pids the node last reported, once they match or after 60 s."""
    reported: list[int] = []
    async with asyncio.timeout(60):
        while reported != expected:
            snapshot = await replicas.fleet_snapshot(client)
            if node in snapshot.nodes:
                reported = sorted(s.pid for s in snapshot.nodes[node].running)
            await asyncio.sleep(0.1)
    return reported


async def test_agent_sigkill_engines_adopted_and_keep_serving(
    system: System, client: Client, tiny: TinyModel, llama_path: LlamaPath
) -> None:
    """On each llama.cpp install path, forced through the agent's setting: the
    portable one (python3 exec'd by a /bin/sh launcher) was taken for a
    stranger by the new agent, which then killed it."""
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    key = system.catalog(spec)
    agent_env = llama_path.agent_env()
    started = await system.start(client, "adopt-node", agent_env=agent_env)
    [agent] = started.agents
    ids = [await replicas.start_replica(client, spec) for _ in range(2)]
    await asyncio.gather(*(replicas.wait_ready(client, r, 120) for r in ids))
    await wait_routable(started.base, key, MODEL)
    pids_before = engine_pids(system.work_dir, "--alias", MODEL)
    assert len(pids_before) == 2
    assert all(llama_path.runs(pid) for pid in pids_before), llama_path

    agent.signal(signal.SIGKILL)
    agent.proc.wait()
    oai = openai.AsyncOpenAI(base_url=started.base, api_key=key, max_retries=0)
    try:
        # With no agent at all, the engines still serve through the router.
        for _ in range(4):
            r = await oai.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert r.usage is not None and r.usage.completion_tokens == 2

        system.spawn("agent", {"LLMGW_NODE_ID": "adopt-node", **agent_env})
        # The old registration (made before any engine ran) reported none;
        # the new agent's reports the adopted engines.
        assert await _reported_pids(client, "adopt-node", pids_before) == pids_before
        assert engine_pids(system.work_dir, "--alias", MODEL) == pids_before, "not restarted"
        agent_log = "".join(c.log_path.read_text() for c in system.children if c.name == "agent")
        assert "adopted 2 engines, 0 shards lost, 0 unidentified engines killed" in agent_log
        for _ in range(4):
            r = await oai.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert r.usage is not None and r.usage.completion_tokens == 2
        for rid in ids:
            memo = await replicas.replica_memo(client, rid)
            assert memo is not None and memo.phase is ReplicaPhase.READY
    finally:
        await oai.close()
    # The new agent can stop what it adopted: the whole group goes.
    for rid in ids:
        final = await replicas.stop_replica(client, rid, "test over", 60)
        assert final.phase is ReplicaPhase.STOPPED
    assert engine_pids(system.work_dir, "--alias", MODEL) == []
