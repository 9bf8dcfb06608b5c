"""Resilience paths with real processes (issue 23 item 16).

- Two control workers polling at once, each with its recovery passes,
  through a scale-up, a rolling restart, a catalog change (a roll both
  workers' passes order) and a scale-down: the deployment converges to
  exactly the wanted replicas, every engine is launched once, and both
  workers did the work.
- The Temporal server restarted (same database) under a running agent and
  router: the router serves from its table through the outage, both
  reconnect, and a start after the restart serves through the router.
- A restarted agent's adoption is traced.
"""

import asyncio
import re
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmgw import replicas
from llmgw.queues import deployment_workflow_id, replica_workflow_id
from llmgw.temporal import connect
from llmgw.types import DeploymentStatus, EngineKind, ModelSpec, ReplicaPhase
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from tests.harness import System, free_port, start_devserver, wait_deployment, wait_routable
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.procs_util import pids_with_args

LAUNCH_LINE = re.compile(r"shard (\S+) started: pid")
FAST_RECONCILE = {"LLMGW_RECONCILE_CATALOG": "true", "LLMGW_RECONCILE_INTERVAL_S": "0.5"}


def _spec(tiny: TinyModel, name: str) -> ModelSpec:
    return ModelSpec(name=name, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))


def _launches(system: System) -> list[str]:
    """Every shard any agent of ``system`` launched, once per launch."""
    keys: list[str] = []
    for log in (system.work_dir / "logs").glob("agent-*.log"):
        keys += LAUNCH_LINE.findall(log.read_text(errors="replace"))
    return keys


def _serving(want: int, old: frozenset[str] = frozenset()) -> Callable[[DeploymentStatus], bool]:
    """A check: ``want`` ready slots, none of them ``old``, no roll under way."""

    def ok(status: DeploymentStatus) -> bool:
        ids = {s.replica_id for s in status.slots}
        return (
            not status.rolling
            and len(status.slots) == want
            and not ids & old
            and all(s.ready and s.replaces is None for s in status.slots)
        )

    return ok


async def _identities(client: Client, workflow_ids: list[str]) -> set[str]:
    """The worker identities that completed a workflow task or started an
    activity of these workflows."""
    kinds = {
        EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED: "workflow_task_completed_event_attributes",
        EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED: "activity_task_started_event_attributes",
    }
    found: set[str] = set()
    for wid in workflow_ids:
        async for e in client.get_workflow_handle(wid).fetch_history_events():
            if e.event_type in kinds:
                found.add(getattr(e, kinds[e.event_type]).identity)
    return found


async def _engines_settle(model: str, want: int) -> list[int]:
    """The model's engine pids once there are ``want`` (old ones take a moment to go)."""
    async with asyncio.timeout(60):
        while len(pids := pids_with_args("--alias", model)) != want:
            await asyncio.sleep(0.2)
    return pids


async def test_two_control_workers_through_a_scale_and_a_rolling_restart(
    system: System, client: Client, tiny: TinyModel
) -> None:
    model = "tiny-two-controls"
    spec = _spec(tiny, model)
    system.catalog(spec)
    # Each control worker also runs its own recovery passes, as by default
    # (here every half second, so they meet every step).
    controls = [system.spawn("control", FAST_RECONCILE) for _ in range(2)]
    system.spawn_agent("two-controls-node")
    await replicas.wait_node_registered(client, "two-controls-node", 60)

    await replicas.apply_deployment(client, spec, 1)
    await wait_deployment(client, model, _serving(1), 180)
    await replicas.apply_deployment(client, spec, 3)
    status = await wait_deployment(client, model, _serving(3), 180)
    first = {s.replica_id for s in status.slots}
    assert len(await _engines_settle(model, 3)) == 3

    restarted = await asyncio.to_thread(system.cli, "restart", model)
    assert restarted.returncode == 0, restarted.stderr
    status = await wait_deployment(client, model, _serving(3, frozenset(first)), 240)
    second = {s.replica_id for s in status.slots}
    assert len(await _engines_settle(model, 3)) == 3
    for rid in first:
        gone = await replicas.status_of(client, rid)
        assert gone is not None and gone.phase is ReplicaPhase.STOPPED, rid

    # The catalog entry changes: both workers' recovery passes see it and
    # tell the deployment; it rolls once.
    changed = spec.model_copy(update={"context_length": 256})
    system.catalog(changed)
    status = await wait_deployment(client, model, _serving(3, frozenset(second)), 240)
    assert status.model_digest == changed.digest()
    third = {s.replica_id for s in status.slots}
    assert len(await _engines_settle(model, 3)) == 3

    await replicas.apply_deployment(client, changed, 1)
    status = await wait_deployment(client, model, _serving(1), 120)
    assert len(await _engines_settle(model, 1)) == 1

    every = first | second | third
    launches = _launches(system)
    twice = [k for k, n in Counter(launches).items() if n > 1]
    assert twice == [], f"launched more than once: {twice}"
    assert len(launches) == len(every), launches  # one shard a replica
    for rid in every - {s.replica_id for s in status.slots}:
        gone = await replicas.status_of(client, rid)
        assert gone is not None and gone.phase is ReplicaPhase.STOPPED, (rid, gone)
    # Both workers did part of it (activities go to whichever worker polls).
    wids = [deployment_workflow_id(model)] + [replica_workflow_id(r) for r in every]
    identities = await _identities(client, wids)
    for control in controls:
        assert control.alive(), control.log_tail()
        assert any(str(control.pid) in i for i in identities), (control.pid, identities)
    await replicas.remove_deployment(client, changed, 60)
    assert await _engines_settle(model, 0) == []


async def _chat(http: httpx.AsyncClient, base: str, key: str, model: str) -> int:
    r = await http.post(
        f"{base}/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "prompt": "hi", "max_tokens": 2},
    )
    return r.status_code


async def _logged(child: Child, line: str, timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while line not in child.log_path.read_text(errors="replace"):
            await asyncio.sleep(0.1)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[tuple[list[Child], int]]:
    """A dev server of this test's own (it is restarted): the running one, its port."""
    port = free_port()
    server = [start_devserver(tmp_path / "temporal.db", port, tmp_path / "temporal-0.log")]
    yield server, port
    for s in server:
        s.stop()


async def test_agent_and_router_through_a_temporal_restart(
    own_server: tuple[list[Child], int], tmp_path: Path, tiny: TinyModel
) -> None:
    servers, port = own_server
    system = System(f"127.0.0.1:{port}", tmp_path / "llmgw", free_port())
    system.work_dir.mkdir()
    try:
        client = await connect(f"127.0.0.1:{port}")
        before, after = _spec(tiny, "tiny-before-restart"), _spec(tiny, "tiny-after-restart")
        key = system.catalog(before, after)
        # Registration rounds each second: the agent meets the outage at once.
        started = await system.start(
            client, "restart-node", agent_env={"LLMGW_REGISTER_INTERVAL_S": "1"}
        )
        [agent] = started.agents
        router = system.children[-1]
        await replicas.apply_deployment(client, before, 1)
        served = await replicas.wait_deployment_ready(client, before.name, 180)
        await wait_routable(started.base, key, before.name, 60)
        engine = pids_with_args("--alias", before.name)

        servers[0].stop()  # SIGTERM, then SIGKILL if it lingers
        assert not servers[0].alive()
        async with httpx.AsyncClient(timeout=30) as http:
            # Both have met the outage ...
            await _logged(router, "routing refresh failed")
            await _logged(agent, "registration round failed")
            # ... and the router's table outlives its source: requests never wait on Temporal.
            during = [await _chat(http, started.base, key, before.name) for _ in range(5)]
            assert during == [200] * 5
            servers.append(start_devserver(tmp_path / "temporal.db", port, tmp_path / "t-1.log"))
            client = await connect(f"127.0.0.1:{port}")
            for child in system.children:
                assert child.alive(), f"{child.name} died:\n{child.log_tail()}"

            # The agent serves its node queue again and the router lists again.
            await replicas.apply_deployment(client, after, 1)
            await replicas.wait_deployment_ready(client, after.name, 240)
            await wait_routable(started.base, key, after.name, 60)
            assert await _chat(http, started.base, key, after.name) == 200
            assert await _chat(http, started.base, key, before.name) == 200
        # The outage cost the running replica nothing: same replica, same engine.
        memo = await replicas.replica_memo(client, served.replica_id)
        assert memo is not None and memo.phase is ReplicaPhase.READY
        assert pids_with_args("--alias", before.name) == engine
        for spec in (before, after):
            await replicas.remove_deployment(client, spec, 60)
        assert pids_with_args("--alias", before.name) == []
        assert pids_with_args("--alias", after.name) == []
    finally:
        system.stop()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    rx = OtlpReceiver()
    yield rx
    rx.close()


async def test_a_restarted_agents_adoption_is_traced(
    system: System, client: Client, tiny: TinyModel, receiver: OtlpReceiver
) -> None:
    node = "adopt-traced-node"
    env = {
        "LLMGW_NODE_ID": node,
        "LLMGW_TRACING__EXPORTER": "otlp",
        "LLMGW_TRACING__ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export promptly
    }
    system.spawn("control")
    agent = system.spawn("agent", env)
    await replicas.wait_node_registered(client, node, 60)
    rid = await replicas.start_replica(client, _spec(tiny, "tiny-adopt-traced"))
    await replicas.wait_ready(client, rid, 180)
    engines = pids_with_args("--alias", "tiny-adopt-traced")
    assert len(engines) == 1

    agent.signal(signal.SIGKILL)
    agent.proc.wait()
    system.spawn("agent", env)

    def adoption() -> list[ReceivedSpan]:
        return [
            s
            for s in receiver.snapshot()
            if s.service == "llmgw-agent"
            and s.name == "agent.adopt"
            and s.attributes.get("llmgw.adopted") == [rid]
        ]

    async with asyncio.timeout(90):
        while not adoption():
            await asyncio.sleep(0.1)
    [span] = adoption()
    assert span.attributes["llmgw.node"] == node
    assert span.attributes.get("llmgw.lost", []) == []
    assert pids_with_args("--alias", "tiny-adopt-traced") == engines, "adopted, not restarted"
    final = await replicas.stop_replica(client, rid, "test over", 60)
    assert final.phase is ReplicaPhase.STOPPED
