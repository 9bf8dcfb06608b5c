"""The replica workflow's decisions on a real Temporal server, with fake
activities registered under the real names (no engine, no agent process)."""

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer, Worker

from llmgw import contracts
from llmgw import search_attributes as sa
from llmgw.queues import node_queue
from llmgw.types import (
    DrainInput,
    DrainResult,
    FetchWeightsInput,
    FetchWeightsResult,
    LaunchShardInput,
    ModelSpec,
    Placement,
    PlaceRequest,
    PlaceResult,
    ProbeEngineInput,
    ProbeEngineResult,
    Rejection,
    ReleaseRequest,
    ReleaseResult,
    ReplicaInput,
    ReplicaPhase,
    ReplicaStatus,
    ReplicaTimeouts,
    ShardExit,
    ShardHandle,
    ShardRef,
    ShardRunning,
    StopReplicaInput,
    StopShardInput,
    StopShardResult,
    ValidateInput,
    ValidateResult,
    WaitReadyInput,
    WaitReadyResult,
    WatchShardInput,
)
from tests.recording import HISTORIES
from workflows.replica import ReplicaWorkflow

P = ReplicaPhase


@dataclass
class Fakes:
    """Node and control activities whose behaviour each test sets."""

    node_id: str
    place_ok: bool = True
    invalid: str = ""
    ready_error: str | None = None
    ready_gate: asyncio.Event = field(default_factory=asyncio.Event)
    engine_exit: asyncio.Event = field(default_factory=asyncio.Event)
    launches: int = 0
    fetches: int = 0
    drains: int = 0
    launched_sources: list[str] = field(default_factory=list)
    stops: int = 0
    releases: int = 0
    # Node loss: the agent stops heartbeating, comes back, or the engine dies.
    agent_silent: asyncio.Event = field(default_factory=asyncio.Event)
    agent_back: asyncio.Event = field(default_factory=asyncio.Event)
    engine_dead: asyncio.Event = field(default_factory=asyncio.Event)
    probes: int = 0
    agent_restarts: int = 0
    watches: int = 0

    def __post_init__(self) -> None:
        self.ready_gate.set()

    @activity.defn(name=contracts.PLACE_REPLICA.name)
    async def place(self, req: PlaceRequest) -> PlaceResult:
        if not self.place_ok:
            return PlaceResult(rejections=[Rejection(node_id="n1", reason="needs 8 GPUs, has 0")])
        return PlaceResult(
            placement=Placement(
                replica_id=req.replica_id, model=req.model.name, node_id=self.node_id
            )
        )

    @activity.defn(name=contracts.VALIDATE_REPLICA.name)
    async def validate(self, req: ValidateInput) -> ValidateResult:
        if self.invalid:
            raise ApplicationError(self.invalid, type="LaunchValidationError", non_retryable=True)
        return ValidateResult()

    @activity.defn(name=contracts.RELEASE_REPLICA.name)
    async def release(self, req: ReleaseRequest) -> ReleaseResult:
        self.releases += 1
        return ReleaseResult(released=True)

    @activity.defn(name=contracts.FETCH_WEIGHTS.name)
    async def fetch(self, req: FetchWeightsInput) -> FetchWeightsResult:
        self.fetches += 1
        return FetchWeightsResult(path="/cache/m.gguf", sha256="0" * 64, size_bytes=1, cached=False)

    @activity.defn(name=contracts.LAUNCH_SHARD.name)
    async def launch(self, req: LaunchShardInput) -> ShardHandle:
        self.launches += 1
        self.launched_sources.append(req.spec.model.source)
        return ShardHandle(
            replica_id=req.spec.replica_id, rank=0, pid=4242, port=1, endpoint="http://127.0.0.1:1"
        )

    @activity.defn(name=contracts.WAIT_SHARD_READY.name)
    async def wait_ready(self, req: WaitReadyInput) -> WaitReadyResult:
        while not self.ready_gate.is_set():
            activity.heartbeat()
            await asyncio.sleep(0.05)
        if self.ready_error:
            raise ApplicationError(self.ready_error, type="EngineNotReadyError", non_retryable=True)
        return WaitReadyResult(model_ids=["m"])

    @activity.defn(name=contracts.WATCH_SHARD.name)
    async def watch(self, req: WatchShardInput) -> ShardExit:
        self.watches += 1
        if self.agent_restarts:
            self.agent_restarts -= 1
            raise ApplicationError("agent shutting down", type="AgentShutdown")
        while not self.engine_exit.is_set():
            # A frozen agent sends no heartbeat; once back, the first one
            # learns that Temporal timed this attempt out (and cancels it).
            if not self.agent_silent.is_set() or self.agent_back.is_set():
                activity.heartbeat()
            await asyncio.sleep(0.05)
        return ShardExit(exit_code=139, reason="engine exited with code 139", log_tail=["segfault"])

    @activity.defn(name=contracts.SHARD_RUNNING.name)
    async def running(self, req: ShardRef) -> ShardRunning:
        # A frozen agent answers nothing: this attempt times out (no heartbeat).
        while self.agent_silent.is_set() and not self.agent_back.is_set():
            await asyncio.sleep(0.05)
        return ShardRunning(pid=4242)

    @activity.defn(name=contracts.PROBE_ENGINE.name)
    async def probe(self, req: ProbeEngineInput) -> ProbeEngineResult:
        self.probes += 1
        while not self.engine_dead.is_set():
            activity.heartbeat()
            await asyncio.sleep(0.05)
        return ProbeEngineResult(last_error="ConnectError: refused", unanswered_s=60.0)

    @activity.defn(name=contracts.DRAIN_SHARD.name)
    async def drain(self, req: DrainInput) -> DrainResult:
        self.drains += 1
        return DrainResult(idle=True, waited_s=0.0)

    @activity.defn(name=contracts.STOP_SHARD.name)
    async def stop(self, req: StopShardInput) -> StopShardResult:
        self.stops += 1
        return StopShardResult(was_running=True, exit_code=0)


@pytest.fixture
async def env(client: Client) -> AsyncIterator[tuple[Client, str, Fakes]]:
    queue = f"control-test-{uuid.uuid4().hex[:8]}"
    fakes = Fakes(node_id=f"fake-{uuid.uuid4().hex[:8]}")
    control = Worker(
        client,
        task_queue=queue,
        workflows=[ReplicaWorkflow],
        activities=[fakes.place, fakes.release, fakes.validate, fakes.probe],
    )
    node = Worker(
        client,
        task_queue=node_queue(fakes.node_id),
        activities=[
            fakes.fetch,
            fakes.launch,
            fakes.wait_ready,
            fakes.watch,
            fakes.drain,
            fakes.stop,
            fakes.running,
        ],
    )
    async with control, node:
        yield client, queue, fakes


async def _start(client: Client, queue: str) -> WorkflowHandle[ReplicaWorkflow, ReplicaStatus]:
    rid = f"wf-{uuid.uuid4().hex[:8]}"
    timeouts = ReplicaTimeouts(
        heartbeat_s=2,
        place_attempts=2,
        place_retry_s=0.1,
        schedule_to_start_s=5,
        router_grace_s=0.05,
    )
    return await client.start_workflow(
        ReplicaWorkflow.run,
        ReplicaInput(
            replica_id=rid, model=ModelSpec(name="m", source="/m.gguf"), timeouts=timeouts
        ),
        id=f"replica/{rid}",
        task_queue=queue,
    )


async def _phase(
    handle: WorkflowHandle[ReplicaWorkflow, ReplicaStatus], phase: ReplicaPhase
) -> None:
    # Polls a remote workflow: there is no local event to wait on.
    async with asyncio.timeout(20):
        while True:
            if (await handle.query(ReplicaWorkflow.status)).phase is phase:
                return
            await asyncio.sleep(0.05)


async def test_ready_then_stop(env: tuple[Client, str, Fakes]) -> None:
    client, queue, fakes = env
    handle = await _start(client, queue)
    await _phase(handle, P.READY)
    # Each publish stamps ReplicaUpdatedAt: the router's delta listing reads it.
    ready_at = (await handle.describe()).typed_search_attributes.get(sa.REPLICA_UPDATED_AT)
    final = await handle.execute_update(
        "stop", StopReplicaInput(reason="test"), result_type=ReplicaStatus
    )
    assert final.phase is P.STOPPED
    stopped_at = (await handle.describe()).typed_search_attributes.get(sa.REPLICA_UPDATED_AT)
    assert ready_at is not None and stopped_at is not None and stopped_at > ready_at
    assert [h.phase for h in final.history] == [
        P.FETCHING,
        P.STARTING,
        P.LOADING,
        P.READY,
        P.DRAINING,
        P.STOPPING,
        P.STOPPED,
    ]
    assert (fakes.launches, fakes.drains, fakes.stops, fakes.releases) == (1, 1, 1, 1)
    # The engine loads the node's cached copy, never the catalog's path.
    assert fakes.launched_sources == ["/cache/m.gguf"]
    assert (await handle.result()).phase is P.STOPPED


async def test_engine_exit_fails_the_replica_with_its_tail(env: tuple[Client, str, Fakes]) -> None:
    client, queue, fakes = env
    handle = await _start(client, queue)
    await _phase(handle, P.READY)
    fakes.engine_exit.set()
    final = await handle.result()
    assert final.phase is P.FAILED
    assert "code 139" in final.reason and final.log_tail == ["segfault"]
    assert fakes.releases == 1 and fakes.stops == 0


# A start that fails at each step: what it says, and what it launched,
# stopped and released (nothing launched is left running, nothing placed is
# left held).
FAILED_STARTS: dict[str, tuple[dict[str, object], str, tuple[int, int, int]]] = {
    "not ready: the engine is stopped and the node released": (
        {"ready_error": "not ready after 600s"},
        "EngineNotReadyError",
        (1, 1, 1),
    ),
    "unplaceable: the reasons, nothing held": (
        {"place_ok": False},
        "needs 8 GPUs, has 0",
        (0, 0, 0),
    ),
    "invalid launch: refused before anything starts": (
        {"invalid": "cannot start: fp8 needs compute capability >= 8.9"},
        "fp8 needs compute capability",
        (0, 0, 1),
    ),
}


@pytest.mark.parametrize("case", FAILED_STARTS)
async def test_a_failed_start_says_why_and_leaves_nothing(
    env: tuple[Client, str, Fakes], case: str
) -> None:
    client, queue, fakes = env
    fault, why, counts = FAILED_STARTS[case]
    for name, value in fault.items():
        setattr(fakes, name, value)
    final = await (await _start(client, queue)).result()
    assert final.phase is P.FAILED
    assert why in final.reason
    assert (fakes.launches, fakes.stops, fakes.releases) == counts


async def test_stop_while_loading(env: tuple[Client, str, Fakes]) -> None:
    client, queue, fakes = env
    fakes.ready_gate.clear()
    handle = await _start(client, queue)
    await _phase(handle, P.LOADING)
    final = await handle.execute_update(
        "stop", StopReplicaInput(reason="abort"), result_type=ReplicaStatus
    )
    assert final.phase is P.STOPPED
    assert P.READY not in [h.phase for h in final.history]
    assert (fakes.stops, fakes.releases) == (1, 1)


async def test_silent_agent_is_node_lost_not_a_dead_engine(
    env: tuple[Client, str, Fakes],
) -> None:
    client, queue, fakes = env
    handle = await _start(client, queue)
    await _phase(handle, P.READY)
    fakes.agent_silent.set()
    await _phase(handle, P.NODE_LOST)
    memo = (await (await handle.describe()).memo())["replica"]
    assert memo["phase"] == "node-lost" and memo["endpoint"] == "http://127.0.0.1:1"
    fakes.agent_back.set()
    await _phase(handle, P.READY)
    status = await handle.query(ReplicaWorkflow.status)
    assert [h.phase for h in status.history][-3:] == [P.READY, P.NODE_LOST, P.READY]
    assert "engine pid 4242 (same pid)" in status.history[-1].detail
    # Nothing was stopped, released or launched again; the engine was probed.
    assert (fakes.launches, fakes.stops, fakes.releases) == (1, 0, 0)
    assert fakes.probes >= 1
    # Watching resumed: the engine's exit still fails the replica.
    fakes.engine_exit.set()
    final = await handle.result()
    assert final.phase is P.FAILED and "code 139" in final.reason


async def test_a_restarted_agent_is_no_lost_node(env: tuple[Client, str, Fakes]) -> None:
    client, queue, fakes = env
    fakes.agent_restarts = 1
    handle = await _start(client, queue)
    await _phase(handle, P.READY)
    async with asyncio.timeout(20):
        while fakes.watches < 2:  # the watch resumed on the "new" agent
            await asyncio.sleep(0.05)
    fakes.engine_exit.set()
    final = await handle.result()
    assert "code 139" in final.reason
    assert P.NODE_LOST not in [h.phase for h in final.history]
    assert fakes.probes == 0


async def test_node_lost_and_engine_silent_fails_and_releases(
    env: tuple[Client, str, Fakes],
) -> None:
    client, queue, fakes = env
    handle = await _start(client, queue)
    await _phase(handle, P.READY)
    fakes.agent_silent.set()
    await _phase(handle, P.NODE_LOST)
    fakes.engine_dead.set()
    final = await handle.result()
    assert final.phase is P.FAILED
    assert "lost and engine unreachable for 60s: ConnectError" in final.reason
    # The GPUs go back to the ledger; nobody can stop an engine on a lost node.
    assert (fakes.releases, fakes.stops) == (1, 0)


async def test_stop_while_node_lost(env: tuple[Client, str, Fakes]) -> None:
    client, queue, fakes = env
    handle = await _start(client, queue)
    await _phase(handle, P.READY)
    fakes.agent_silent.set()
    await _phase(handle, P.NODE_LOST)
    final = await handle.execute_update(
        "stop", StopReplicaInput(reason="scaled down"), result_type=ReplicaStatus
    )
    assert final.phase is P.STOPPED
    assert P.DRAINING in [h.phase for h in final.history]
    assert (fakes.drains, fakes.releases) == (0, 1)


async def test_fresh_history_replays_deterministically(env: tuple[Client, str, Fakes]) -> None:
    client, queue, _ = env
    handle = await _start(client, queue)
    await _phase(handle, P.READY)
    await handle.execute_update(
        "stop", StopReplicaInput(reason="replay"), result_type=ReplicaStatus
    )
    history = await handle.fetch_history()
    if os.environ.get("LLMGW_RECORD_HISTORIES"):
        (HISTORIES / "replica_ready_stop_fetch.json").write_text(history.to_json())
    result = await Replayer(
        workflows=[ReplicaWorkflow], data_converter=pydantic_data_converter
    ).replay_workflow(history)
    assert result.replay_failure is None
