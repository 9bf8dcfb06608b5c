"""A silent agent is not a dead engine (issue 14, DESIGN §8), with real
processes: the agent frozen with SIGSTOP while its engine serves through the
router, and a lost node whose engine really is gone."""

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

import openai
from temporalio.client import Client

from llmgw import replicas
from llmgw.types import DeploymentStatus, ModelSpec, ReplicaPhase, ReplicaTimeouts, RestartPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, wait_phase, wait_routable
from tests.procs_util import pids_with_args

FREEZE_S = 100.0


@dataclass
class Load:
    """Sequential completions through the router until told to stop."""

    oai: openai.AsyncOpenAI
    model: str
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while not self.stop.is_set():
            try:
                r = await self.oai.completions.create(model=self.model, prompt="hi", max_tokens=2)
                assert r.usage is not None and r.usage.completion_tokens == 2
                self.ok += 1
            except (openai.APIError, AssertionError) as exc:
                self.failed.append(f"{time.monotonic():.1f}: {exc!r}")
            await asyncio.sleep(0.1)


async def _deployment(client: Client, model: str, timeout_s: float) -> DeploymentStatus:
    """The deployment once it has exactly its desired replicas, all ready."""
    async with asyncio.timeout(timeout_s):
        while True:
            status = await replicas.deployment_status(client, model)
            # A slot in restart backoff keeps its last replica's id: not live.
            live = [s for s in status.slots if s.replica_id and not s.next_start_at]
            memos = [await replicas.replica_memo(client, s.replica_id) for s in live]
            serving = [m for m in memos if m is not None and m.phase is ReplicaPhase.READY]
            if len(live) == len(status.slots) == len(serving) == status.desired:
                return status
            await asyncio.sleep(0.2)


async def test_frozen_agent_never_takes_down_a_serving_engine(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name="tiny-frozen", source=str(tiny.model_path))
    key = system.catalog(spec)
    started = await system.start(client, "frozen-node", own_ports=True)
    [agent] = started.agents
    await replicas.apply_deployment(client, spec, 1)
    memo = await replicas.wait_deployment_ready(client, spec.name, 120)
    base = started.base
    await wait_routable(base, key, spec.name)
    engines = pids_with_args("--alias", spec.name)
    assert len(engines) == 1

    oai = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
    load = Load(oai, spec.name)
    sending = asyncio.create_task(load.run())
    try:
        agent.signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        to_lost = await wait_phase(client, memo.replica_id, ReplicaPhase.NODE_LOST, 90)
        # Still lost, still serving, for the whole freeze.
        await asyncio.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))
        lost = await replicas.replica_memo(client, memo.replica_id)
        assert lost is not None and lost.phase is ReplicaPhase.NODE_LOST
        served_frozen = load.ok
        agent.signal(signal.SIGCONT)
        to_ready = await wait_phase(client, memo.replica_id, ReplicaPhase.READY, 90)
        status = await _deployment(client, spec.name, 60)
        after = load.ok
        async with asyncio.timeout(30):
            while load.ok < after + 20:
                await asyncio.sleep(0.1)
    finally:
        load.stop.set()
        await sending
        await oai.close()
        agent.signal(signal.SIGCONT)
    print(
        f"\nnode-lost {to_lost:.1f}s after the freeze; {served_frozen} requests served "
        f"during {FREEZE_S:.0f}s frozen, {len(load.failed)} failed; "
        f"ready {to_ready:.1f}s after SIGCONT"
    )
    assert load.failed == []
    assert pids_with_args("--alias", spec.name) == engines, "the engine was restarted"
    assert [s.replica_id for s in status.slots] == [memo.replica_id]
    final = await replicas.status_of(client, memo.replica_id)
    assert final is not None
    phases = [h.phase for h in final.history]
    assert phases[-2:] == [ReplicaPhase.NODE_LOST, ReplicaPhase.READY]
    assert "(same pid)" in final.history[-1].detail


async def test_lost_node_whose_engine_died_fails_frees_the_gpu_and_converges(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name="tiny-gone", source=str(tiny.model_path))
    key = system.catalog(spec)
    started = await system.start(client, "gone-node", own_ports=True)
    [agent] = started.agents
    quick = ReplicaTimeouts(
        heartbeat_s=2,
        probe_interval_s=1,
        engine_unreachable_s=5,
        schedule_to_start_s=5,
        place_retry_s=1,
        place_attempts=1000,
        router_grace_s=0.5,
    )
    await replicas.apply_deployment(
        client, spec, 1, timeouts=quick, restart=RestartPolicy(initial_backoff_s=0.5)
    )
    memo = await replicas.wait_deployment_ready(client, spec.name, 120)
    await wait_routable(started.base, key, spec.name)
    [engine] = pids_with_args("--alias", spec.name)

    agent.signal(signal.SIGSTOP)
    try:
        await wait_phase(client, memo.replica_id, ReplicaPhase.NODE_LOST, 60)
        # The engine dies while nobody on the node can tell.
        os.kill(engine, signal.SIGKILL)
        final = await replicas.status_of(client, memo.replica_id)
        async with asyncio.timeout(60):
            while final is None or final.phase is not ReplicaPhase.FAILED:
                await asyncio.sleep(0.2)
                final = await replicas.status_of(client, memo.replica_id)
        assert "engine unreachable" in final.reason
        snapshot = await replicas.fleet_snapshot(client)
        assert memo.replica_id not in snapshot.allocations, "its GPU was not released"
    finally:
        agent.signal(signal.SIGCONT)
    # The agent is back: what is left of the old replica is cleaned up and the
    # deployment serves its one replica again.
    status = await _deployment(client, spec.name, 120)
    [slot] = status.slots
    assert slot.replica_id != memo.replica_id
    await wait_routable(started.base, key, spec.name)
    async with asyncio.timeout(60):
        while len(pids_with_args("--alias", spec.name)) != 1:
            await asyncio.sleep(0.2)
