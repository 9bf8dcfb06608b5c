"""The shard service's loops without Temporal: a scripted supervisor and an
engine answering over httpx's MockTransport, both passed to the constructor,
and a heartbeat that records what it is told."""

import ast
import asyncio
from pathlib import Path

import httpx
import pytest

from llmgw.errors import AgentShutdown, EngineExitedError, EngineNotReadyError
from llmgw.types import DrainInput, ShardRef, WaitReadyInput, WatchShardInput
from worker_agent.shard_record import ShardRecord
from worker_agent.shard_service import REDACTED, RunningShards
from worker_agent.supervisor import RunningShard, StopOutcome

ROOT = Path(__file__).resolve().parents[2]
REF = ShardRef(replica_id="r-1")
KEY = "llmgw-engine-" + "ab" * 16
ENDPOINT = "http://engine.test"


class Engines:
    """A supervisor whose engine runs ``rounds`` more looks, then is gone."""

    def __init__(self, rounds: int, *, sidecar: tuple[str, int] | None = None) -> None:
        self.rounds = rounds
        self.sidecar = sidecar
        self.calls: list[str] = []

    def find_running(self, ref: ShardRef) -> RunningShard | None:
        if self.rounds <= 0:
            return None
        self.rounds -= 1
        return RunningShard(ref=ref, pid=4242, port=1, endpoint=ENDPOINT, log_path=Path("x"))

    def plan_of(self, ref: ShardRef) -> ShardRecord:
        return ShardRecord(model="tiny", engine="llama.cpp")

    def dead_sidecar(self, ref: ShardRef) -> tuple[str, int] | None:
        return self.sidecar

    def exit_code(self, ref: ShardRef) -> int | None:
        return 137

    def stopped_on_request(self, ref: ShardRef) -> bool:
        return False

    def log_tail(self, ref: ShardRef, lines: int) -> list[str]:
        return [f"server listening, --api-key {KEY}", f"key {KEY}"]

    def trim_log(self, ref: ShardRef) -> bool:
        self.calls.append("trim_log")
        return False

    def stop(self, ref: ShardRef, grace_s: float) -> StopOutcome:
        self.calls.append(f"stop {grace_s:g}")
        return StopOutcome(was_running=True, exit_code=0)

    def kill_leftovers(self, ref: ShardRef) -> list[int]:
        self.calls.append("kill_leftovers")
        return []


def engine(health: list[int], *, slots: list[int] | None = None) -> httpx.AsyncClient:
    """An engine whose /health answers ``health`` in turn (200 once spent),
    and whose /slots show ``slots`` busy in turn (0 once spent)."""
    health, slots = list(health), list(slots or [])

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == f"Bearer {KEY}"
        if request.url.path == "/health":
            return httpx.Response(health.pop(0) if health else 200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json={"choices": [{"text": "hi"}]})
        if request.url.path == "/slots":
            busy = slots.pop(0) if slots else 0
            return httpx.Response(200, json=[{"is_processing": i < busy} for i in range(2)])
        return httpx.Response(404)

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def service(engines: Engines, http: httpx.AsyncClient) -> RunningShards:
    return RunningShards(engines, lambda replica_id: KEY, http)


async def test_wait_heartbeats_each_probe_until_the_engine_serves() -> None:
    beats: list[str] = []
    async with engine([503, 503]) as http:
        ready = await service(Engines(rounds=10), http).wait_ready(
            WaitReadyInput(shard=REF, timeout_s=60, poll_interval_s=0), beats.append
        )
    assert ready.model_ids == ["tiny"]
    assert beats == ["/health 503", "/health 503"]


async def test_wait_raises_with_the_redacted_tail_when_the_engine_exits() -> None:
    beats: list[str] = []
    async with engine([503] * 10) as http:
        with pytest.raises(EngineExitedError) as exited:
            await service(Engines(rounds=2), http).wait_ready(
                WaitReadyInput(shard=REF, timeout_s=60, poll_interval_s=0), beats.append
            )
    assert beats == ["/health 503", "/health 503"]
    assert "engine exited with code 137 while loading" in str(exited.value)
    assert KEY not in str(exited.value) and REDACTED in str(exited.value)


async def test_wait_gives_up_at_its_deadline() -> None:
    beats: list[str] = []
    async with engine([503] * 10) as http:
        with pytest.raises(EngineNotReadyError, match=r"not ready after 0s \(last: /health 503\)"):
            await service(Engines(rounds=10), http).wait_ready(
                WaitReadyInput(shard=REF, timeout_s=0, poll_interval_s=0), beats.append
            )
    assert beats == ["/health 503"]


async def test_watch_heartbeats_while_the_engine_runs_and_reports_its_exit() -> None:
    beats: list[str] = []
    engines = Engines(rounds=3)
    async with engine([]) as http:
        ended = await service(engines, http).watch(
            WatchShardInput(shard=REF, poll_interval_s=0), beats.append
        )
    assert beats == ["running"] * 3
    assert engines.calls == ["trim_log"] * 3 + ["kill_leftovers"]
    assert ended.exit_code == 137 and ended.reason == "engine exited with code 137"
    assert all(KEY not in line for line in ended.log_tail)


async def test_watch_stops_an_engine_whose_pass_through_died() -> None:
    beats: list[str] = []
    engines = Engines(rounds=3, sidecar=("pass-through", 1))
    async with engine([]) as http:
        ended = await service(engines, http).watch(
            WatchShardInput(shard=REF, poll_interval_s=0), beats.append
        )
    assert beats == []
    assert engines.calls == ["stop 5"]  # its leftovers went with the stop
    assert ended.reason == "pass-through exited with code 1; engine stopped"


async def test_watch_ends_when_the_agent_leaves_and_the_engine_stays() -> None:
    beats: list[str] = []
    engines = Engines(rounds=10)
    async with engine([]) as http:
        with pytest.raises(AgentShutdown):
            await service(engines, http).watch(
                WatchShardInput(shard=REF, poll_interval_s=0), beats.append, lambda: bool(beats)
            )
    assert beats == ["running"]
    assert "kill_leftovers" not in engines.calls and "stop 5" not in engines.calls


async def test_a_cancelled_watch_is_cancelled_as_asyncio_cancels() -> None:
    beating = asyncio.Event()
    engines = Engines(rounds=10**6)
    async with engine([]) as http:
        watch = asyncio.create_task(
            service(engines, http).watch(
                WatchShardInput(shard=REF, poll_interval_s=0.01), lambda _: beating.set()
            )
        )
        await asyncio.wait_for(beating.wait(), 30)
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch
    assert "kill_leftovers" not in engines.calls  # the engine was left running


async def test_drain_heartbeats_until_the_engine_is_idle() -> None:
    beats: list[str] = []
    async with engine([], slots=[2, 1]) as http:
        drained = await service(Engines(rounds=10), http).drain(
            DrainInput(shard=REF, timeout_s=60, poll_interval_s=0), beats.append
        )
    assert beats == ["2 slots processing", "1 slots processing"]
    assert drained.idle and drained.detail == "0 slots processing"


def test_the_agent_does_not_import_the_activity_layer() -> None:
    """activities/agent/ adapts the agent's services to Temporal and imports
    them; an import back would make the two one package cycle again."""
    found = []
    for path in sorted((ROOT / "worker_agent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "activities"
            ]
    assert found == []
