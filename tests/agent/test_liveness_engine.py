"""Engine liveness with a real llama-server under the real supervisor, on
each install path: a frozen engine (SIGSTOP: alive, answering nothing) is
found hung by ``RunningShards.watch``, killed and freed as a stop frees it;
an engine kept busy by a long generation is probed round after round and
left alone, and its request completes.

Short liveness settings (tenths of a second) against the tiny model; every
wait is on a condition, bounded generously (the machine may be loaded).
"""

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from llmgw.engine_keys import engine_key
from llmgw.types import (
    EngineKind,
    LaunchShardInput,
    ModelSpec,
    ShardHandle,
    ShardRef,
    ShardSpec,
    StopShardInput,
    WaitReadyInput,
    WatchShardInput,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.conftest import LlamaPath
from tests.harness import cpu_inventory, free_port, llama_only
from tests.procs_util import pids_with_args
from worker_agent import procfs
from worker_agent.launch import Launcher
from worker_agent.liveness import ENGINE_HUNG, LivenessRules
from worker_agent.probes import metric_values
from worker_agent.shard_service import ShardService
from worker_agent.supervisor import Supervisor

SECRET = "liveness-secret"


@dataclass
class Probes:
    """What the engine answered the watch's liveness probes (the client's hook sees them)."""

    in_flight: list[float] = field(default_factory=list)

    async def saw(self, response: httpx.Response) -> None:
        if response.request.url.path == "/metrics" and response.status_code == 200:
            await response.aread()
            values = metric_values(response.text)
            self.in_flight.append(values.get("llamacpp:requests_processing", -1.0))


@dataclass
class Shard:
    service: ShardService
    supervisor: Supervisor
    handle: ShardHandle
    ref: ShardRef
    probes: Probes

    @property
    def key(self) -> str:
        return engine_key(SECRET, self.ref.replica_id)


@contextlib.asynccontextmanager
async def ready_engine(
    llama_path: LlamaPath, tiny: TinyModel, work: Path, name: str, rules: LivenessRules
) -> AsyncIterator[Shard]:
    """The tiny model launched by a shard service with ``rules``, ready; stopped afterwards."""
    supervisor = Supervisor(work)
    probes = Probes()
    service = shard_service(llama_path, supervisor, rules, probes)
    # Four slots (llama-server's default), each with the model's whole context.
    model = ModelSpec(
        name=name, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path), context_length=8192
    )
    ref = ShardRef(replica_id=f"{name}-1")
    try:
        handle = await service.launch(
            LaunchShardInput(spec=ShardSpec(replica_id=ref.replica_id, model=model)), print
        )
        try:
            await service.wait_ready(WaitReadyInput(shard=ref, timeout_s=120), print)
            yield Shard(service, supervisor, handle, ref, probes)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGCONT)
            await service.stop(StopShardInput(shard=ref, grace_s=5))
    finally:
        await service.aclose()


def shard_service(
    llama_path: LlamaPath, supervisor: Supervisor, rules: LivenessRules, probes: Probes
) -> ShardService:
    """An agent's shard service over ``supervisor``'s work dir, probing with ``rules``."""
    http = httpx.AsyncClient(timeout=httpx.Timeout(5.0), event_hooks={"response": [probes.saw]})
    start = free_port()
    return ShardService(
        Launcher(
            supervisor=supervisor,
            installs=llama_only(llama_path.install, supervisor.work_dir),
            engine_key=lambda rid: engine_key(SECRET, rid),
            engine_host="127.0.0.1",
            ports=range(start, start + 50),
            inventory=cpu_inventory,
            threads=1,
        ),
        http,
        rules,
    )


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("watcher", ["launcher", "restarted-agent"])
async def test_a_frozen_engine_is_found_hung_killed_and_freed(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path, watcher: str
) -> None:
    """Watched by the agent that launched it, or by a new agent on the same
    work dir (an agent restart: the engine adopted, its plan read from its
    record)."""
    rules = LivenessRules(interval_s=0.2, timeout_s=1.0, rounds=3, unanswered_s=1.0, stall_s=0)
    async with contextlib.AsyncExitStack() as stack:
        shard = await stack.enter_async_context(
            ready_engine(llama_path, tiny, tmp_path, "tiny-frozen", rules)
        )
        service, sup, ref = shard.service, shard.supervisor, shard.ref
        if watcher == "restarted-agent":
            sup = Supervisor(tmp_path)
            service = shard_service(llama_path, sup, rules, Probes())
            stack.push_async_callback(service.aclose)
        running = sup.find_running(ref)
        assert running is not None
        internal = sup.plan_of(ref).internal_port
        scratch = Path((sup.shard_dir(ref) / "scratch-path").read_text().strip())
        assert scratch.is_dir() and internal is not None
        assert pids_with_args("--alias", "tiny-frozen") == [shard.handle.pid]
        # Frozen: its process lives (and its pass-through answers the
        # connection), but nothing inside answers.
        os.kill(shard.handle.pid, signal.SIGSTOP)
        beats: list[str] = []
        async with asyncio.timeout(120):  # about 3 rounds of 1 s, then the stop's grace
            ended = await service.watch(
                WatchShardInput(shard=ref, poll_interval_s=0.1), beats.append
            )
        assert ended.reason.startswith(ENGINE_HUNG), ended
        assert "unanswered 3 times" in ended.reason and "no answer within 1s" in ended.reason
        assert "running; liveness: 1/3 unanswered (no answer within 1s)" in beats
        # Gone, not left stopped: SIGTERM waits on a stopped process, SIGKILL does not.
        assert pids_with_args("--alias", "tiny-frozen") == []
        assert procfs.group_members(running.group) == []
        if watcher == "launcher":  # its own children: reaped too
            assert not Path(f"/proc/{shard.handle.pid}").exists()
            assert not Path(f"/proc/{running.group}").exists()
        # Freed as a stop frees a shard: its record, scratch dir and ports.
        assert sup.find_running(ref) is None and sup.recorded() == []
        assert not scratch.exists()
        assert sup.used_ports() == set()
        assert _port_free(running.port) and _port_free(internal)


async def test_a_busy_engine_is_probed_and_left_alone(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    # Rules as tight as the first test's, and a stall of a few seconds: the
    # engine's progress figure must keep moving through the prompt and the
    # generation for the watch to let it be.
    rules = LivenessRules(interval_s=0.1, timeout_s=5.0, rounds=3, unanswered_s=1.0, stall_s=3.0)
    async with ready_engine(llama_path, tiny, tmp_path, "tiny-busy", rules) as shard:
        beats: list[str] = []
        watch = asyncio.create_task(
            shard.service.watch(
                WatchShardInput(shard=shard.ref, poll_interval_s=0.05), beats.append
            )
        )
        try:
            headers = {"Authorization": f"Bearer {shard.key}"}
            # A long prompt, and a generation to the end of the context (the
            # tiny model never stops early): several probe rounds while it works.
            body = {"prompt": "the " * 600, "max_tokens": 1400}
            async with httpx.AsyncClient(timeout=300) as client:
                asks = [
                    client.post(
                        f"{shard.handle.endpoint}/v1/completions", json=body, headers=headers
                    )
                    for _ in range(2)
                ]
                answers = await asyncio.gather(*asks)
            for answer in answers:
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 1400
            busy_rounds = [n for n in shard.probes.in_flight if n > 0]
            assert len(busy_rounds) >= 3, shard.probes.in_flight
            assert not watch.done(), watch.result()
            # And once idle again, still watched, never suspected.
            seen = len(shard.probes.in_flight)
            async with asyncio.timeout(60):
                while len(shard.probes.in_flight) < seen + 3:
                    await asyncio.sleep(0.05)
            assert not watch.done()
            assert not any(b.startswith("engine hung") for b in beats)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
