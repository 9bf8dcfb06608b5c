"""Node activities: launch, wait-ready, watch and stop engine shards.

Served by the node agent on ``node-<id>``: the Temporal layer (heartbeats,
activity failures) over the agent's own modules, ``worker_agent/launch.py``
(ports, cores, the plan, the pass-through, the spec record),
``worker_agent/probes.py`` (readiness and load) and the supervisor.
At-least-once delivery means each may run twice: launch finds a running
engine before starting one, stop is a no-op on a stopped shard, wait and
watch are pure observation.
"""

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import httpx
from opentelemetry import trace
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from llmgw import error_types
from llmgw.errors import (
    ConfigError,
    EngineExitedError,
    EngineNotReadyError,
    LlmgwError,
)
from llmgw.types import (
    DrainInput,
    DrainResult,
    EngineKind,
    FetchWeightsInput,
    FetchWeightsResult,
    LaunchShardInput,
    LogTail,
    LogTailInput,
    PortReservation,
    ShardExit,
    ShardHandle,
    ShardLoad,
    ShardRef,
    ShardRunning,
    StopShardInput,
    StopShardResult,
    WaitReadyInput,
    WaitReadyResult,
    WatchShardInput,
)
from worker_agent.engines import LaunchValidationError, ReadyProbe
from worker_agent.installs.steps import EngineInstallError
from worker_agent.launch import LOOPBACK_KEY_PREFIX, Launcher
from worker_agent.probes import engine_busy, engine_load, probe_ready
from worker_agent.supervisor import RunningShard
from worker_agent.weights import WeightsError

log = logging.getLogger(__name__)

T = TypeVar("T")

REDACTED = "[redacted]"
# A key as engines print their arguments: SGLang's ``server_args=ServerArgs(...,
# api_key='...')``, vLLM's ``api_key=['...']``, a command line's ``--api-key
# ...``; whatever the key, not only this replica's.
_KEY_SETTING = re.compile(
    r"""(?i)((?:--)?api[_-]?keys?["']?\s*[=:]?\s*\[?\s*["']?)([^\s"',)\]]+)"""
)
# Keys printed bare: a replica's engine key, and an engine's own loopback key
# (worker_agent/launch.py new_loopback_key; not kept by the agent, so matched
# by its prefix). Engines from before loopback keys hold the replica key.
_BARE_KEY = re.compile(
    r"llmgw-engine-[0-9a-f]{16,}|" + re.escape(LOOPBACK_KEY_PREFIX) + r"[0-9a-f]{16,}"
)


def redacted(lines: Sequence[str], keys: Sequence[str]) -> list[str]:
    """``lines`` of an engine's log with ``keys`` and any printed API key
    setting replaced: a log tail goes into failure reasons, Temporal
    histories, the admin API and the router's errors, where no key belongs."""
    out = []
    for line in lines:
        clean = _KEY_SETTING.sub(lambda m: m.group(1) + REDACTED, line)
        clean = _BARE_KEY.sub(REDACTED, clean)
        for key in keys:
            if key:
                clean = clean.replace(key, REDACTED)
        out.append(clean)
    return out


async def _heartbeat_while(work: Awaitable[T], detail: Callable[[], str]) -> T:
    """Await blocking work run in a thread, heartbeating every second meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        activity.heartbeat(detail())
        await asyncio.wait({task}, timeout=1.0)
    return task.result()


class NodeActivities:
    """The activities of one node; dependencies come through the constructor."""

    def __init__(self, launcher: Launcher, http: httpx.AsyncClient | None = None) -> None:
        """``launcher``: the node's supervisor, engine installs (the one table
        of engine planners), weights cache and engine keys, and what
        launches decide; ``http``: the client readiness and load checks use."""
        self._launcher = launcher
        self._sup = launcher.supervisor
        self._installs = launcher.installs
        self._weights = launcher.weights
        self._engine_key = launcher.engine_key
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(5.0))

    async def aclose(self) -> None:
        """Close the HTTP client used for readiness checks."""
        await self._http.aclose()

    def _log_tail(self, ref: ShardRef, lines: int) -> list[str]:
        """The engine's last lines, its key redacted (they leave the node)."""
        return redacted(self._sup.log_tail(ref, lines), [self._engine_key(ref.replica_id)])

    @activity.defn(name=names.FETCH_WEIGHTS)
    async def fetch_weights(self, request: FetchWeightsInput) -> FetchWeightsResult:
        """Bring the weights into the node's cache, verified, heartbeating progress."""
        if self._weights is None:
            raise ConfigError("this agent has no weights cache").to_application_error()
        await self._ensure_engine(request.engine, request.device)
        cache = self._weights
        done = [0, 0]

        def progress(copied: int, total: int) -> None:
            done[0], done[1] = copied, total  # read by the heartbeat loop below

        try:
            fetched = await _heartbeat_while(
                asyncio.to_thread(cache.fetch, request.source, request.sha256, progress),
                lambda: f"{done[0]}/{done[1]} bytes",
            )
        except WeightsError as err:
            raise err.to_application_error() from err
        log.info(
            "replica %s weights at %s (%d bytes, %s)",
            request.replica_id,
            fetched.path,
            fetched.size_bytes,
            "cached" if fetched.cached else "fetched",
        )
        return FetchWeightsResult(
            path=str(fetched.path),
            sha256=fetched.sha256,
            size_bytes=fetched.size_bytes,
            cached=fetched.cached,
        )

    async def _ensure_engine(self, engine: EngineKind | None, device: str) -> None:
        """Install the engine on this node if it is not yet (heartbeating its progress)."""
        if engine is None:
            return
        installs = self._installs
        last = ["checking the engine install"]

        def progress(line: str) -> None:
            last[0] = line  # read by the heartbeat loop
            log.info("engine install: %s", line)

        span = trace.get_tracer(__name__).start_as_current_span(
            "engine.install", attributes={"llmgw.engine": engine.value, "llmgw.device": device}
        )
        try:
            with span:  # a step of its caller's trace (the replica start), minutes when new
                await _heartbeat_while(
                    asyncio.to_thread(installs.ensure, engine, device, progress), lambda: last[0]
                )
        except EngineInstallError as err:
            # Not retried here: the replica fails with the reason, and its
            # deployment's backoff decides when to try again.
            raise ApplicationError(
                f"installing {engine.value} failed: {err}",
                type=error_types.ENGINE_INSTALL_ERROR,
                non_retryable=True,
            ) from err

    @activity.defn(name=names.RESERVE_PORT)
    async def reserve_port(self, ref: ShardRef) -> PortReservation:
        """A port for a shard that peers must know before it starts (idempotent)."""
        return await self._launcher.reserve_port(ref)

    @activity.defn(name=names.LAUNCH_SHARD)
    async def launch_shard(self, request: LaunchShardInput) -> ShardHandle:
        """Start a shard, or return the one already running for it."""
        spec = request.spec
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        async with self._launcher.shard_lock(ref):
            found = self._sup.find_running(ref)
            if found is not None:
                log.info("replica %s rank %d already running", ref.replica_id, ref.rank)
                return _handle(found, already_running=True)
            await self._ensure_engine(spec.model.engine, spec.model.profile.device)
            try:
                async with self._launcher.planned(spec) as launch:
                    running = await _heartbeat_while(
                        asyncio.to_thread(self._launcher.start, spec, launch),
                        lambda: "waiting for the rendezvous point",
                    )
            except LaunchValidationError as err:
                raise ConfigError(str(err)).to_application_error() from err
            except LlmgwError as err:
                raise err.to_application_error() from err
        log.info("replica %s rank %d launched pid %d", ref.replica_id, ref.rank, running.pid)
        return _handle(running, already_running=False)

    @activity.defn(name=names.WAIT_SHARD_READY)
    async def wait_shard_ready(self, request: WaitReadyInput) -> WaitReadyResult:
        """Wait until the shard serves (or, for a worker rank, stays alive)."""
        ref = request.shard
        plan = self._sup.plan_of(ref)
        if not plan.serves_http:
            # A worker rank is judged by staying alive; the replica's
            # readiness is its leader answering, once every worker joined.
            self._running_or_raise(ref)
            return WaitReadyResult(model_ids=[])
        probe = plan.ready_probe if plan.ready_probe is not None else ReadyProbe()
        model = plan.model
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.timeout_s
        while True:
            running = self._running_or_raise(ref)
            key = self._engine_key(ref.replica_id)
            ids, last = await probe_ready(self._http, running.endpoint, key, model, probe)
            if ids is not None:
                log.info("replica %s ready: %s", ref.replica_id, ids)
                return WaitReadyResult(model_ids=ids)
            activity.heartbeat(last)
            if loop.time() >= deadline:
                raise EngineNotReadyError(
                    f"not ready after {request.timeout_s:.0f}s (last: {last})"
                ).to_application_error()
            await asyncio.sleep(request.poll_interval_s)

    @activity.defn(name=names.WATCH_SHARD)
    async def watch_shard(self, request: WatchShardInput) -> ShardExit:
        """Return when the shard's engine exits; heartbeat while it runs."""
        ref = request.shard
        sidecar: tuple[str, int] | None = None
        while self._sup.find_running(ref) is not None:
            if activity.is_worker_shutdown():
                # The engine outlives the agent; a retry on the next agent
                # process resumes watching it.
                raise ApplicationError("agent shutting down", type=error_types.AGENT_SHUTDOWN)
            sidecar = self._sup.dead_sidecar(ref)
            if sidecar is not None:
                # An engine nobody can reach (its pass-through is gone) is down.
                await asyncio.to_thread(self._sup.stop, ref, 5.0)
                break
            activity.heartbeat("running")
            self._sup.trim_log(ref)
            await asyncio.sleep(request.poll_interval_s)
        code = self._sup.exit_code(ref)
        if sidecar is None:
            # Whatever killed the leader, its children (vLLM's EngineCore and
            # workers, the pass-through) must not outlive it.
            await asyncio.to_thread(self._sup.kill_leftovers, ref)
        tail = self._log_tail(ref, 30)
        if sidecar is not None:
            reason = f"{sidecar[0]} exited with code {sidecar[1]}; engine stopped"
            log.warning("replica %s rank %d: %s", ref.replica_id, ref.rank, reason)
            return ShardExit(exit_code=code, reason=reason, log_tail=tail)
        if self._sup.stopped_on_request(ref):
            # The stop raced this watch's cancellation: not a failure.
            return ShardExit(exit_code=code, reason="stopped on request", log_tail=tail)
        log.warning("replica %s rank %d engine exited (code %s)", ref.replica_id, ref.rank, code)
        return ShardExit(exit_code=code, reason=f"engine exited with code {code}", log_tail=tail)

    @activity.defn(name=names.DRAIN_SHARD)
    async def drain_shard(self, request: DrainInput) -> DrainResult:
        """Wait, bounded, until the engine has no request in flight."""
        ref = request.shard
        running = self._sup.find_running(ref)
        if running is None:
            return DrainResult(idle=True, waited_s=0.0, detail="not running")
        engine = self._sup.plan_of(ref).engine
        key = self._engine_key(ref.replica_id)
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            busy, detail = await engine_busy(self._http, running.endpoint, key, engine)
            waited = loop.time() - start
            if busy is not True:
                return DrainResult(idle=busy is False, waited_s=waited, detail=detail)
            if waited >= request.timeout_s:
                log.warning("replica %s drain deadline passed: %s", ref.replica_id, detail)
                return DrainResult(idle=False, waited_s=waited, detail=detail)
            activity.heartbeat(detail)
            await asyncio.sleep(request.poll_interval_s)

    @activity.defn(name=names.SHARD_LOAD)
    async def shard_load(self, request: ShardRef) -> ShardLoad:
        """Requests in flight on the shard's engine (a deployment scaling down
        drains the least loaded replica)."""
        running = self._sup.find_running(request)
        if running is None:
            return ShardLoad(in_flight=0.0, detail="not running")
        engine = self._sup.plan_of(request).engine
        key = self._engine_key(request.replica_id)
        load, detail = await engine_load(self._http, running.endpoint, key, engine)
        return ShardLoad(in_flight=load, detail=detail)

    @activity.defn(name=names.SHARD_RUNNING)
    async def shard_running(self, request: ShardRef) -> ShardRunning:
        """The shard's engine as this agent finds it (a replica whose node was
        lost asks this when the agent is back: same pid means adopted)."""
        running = self._sup.find_running(request)
        if running is not None:
            return ShardRunning(pid=running.pid)
        code = self._sup.exit_code(request)
        tail = self._log_tail(request, 30)
        reason = f"engine exited (code {code}) while its node was lost"
        return ShardRunning(pid=None, exit=ShardExit(exit_code=code, reason=reason, log_tail=tail))

    @activity.defn(name=names.STOP_SHARD)
    async def stop_shard(self, request: StopShardInput) -> StopShardResult:
        """Stop the shard's process group; a no-op when it is not running."""
        outcome = await asyncio.to_thread(self._sup.stop, request.shard, request.grace_s)
        return StopShardResult(was_running=outcome.was_running, exit_code=outcome.exit_code)

    @activity.defn(name=names.SHARD_LOG_TAIL)
    async def shard_log_tail(self, request: LogTailInput) -> LogTail:
        """The last lines the shard's engine wrote (bounded)."""
        return LogTail(lines=self._log_tail(request.shard, request.lines))

    def _running_or_raise(self, ref: ShardRef) -> RunningShard:
        running = self._sup.find_running(ref)
        sidecar = self._sup.dead_sidecar(ref)
        if running is not None and sidecar is not None:
            tail = "\n".join(self._log_tail(ref, 20))
            raise EngineExitedError(
                f"{sidecar[0]} exited with code {sidecar[1]} while loading; log tail:\n{tail}"
            ).to_application_error()
        if running is None:
            code = self._sup.exit_code(ref)
            tail = "\n".join(self._log_tail(ref, 20))
            raise EngineExitedError(
                f"engine exited with code {code} while loading; log tail:\n{tail}"
            ).to_application_error()
        return running


def _handle(running: RunningShard, *, already_running: bool) -> ShardHandle:
    return ShardHandle(
        replica_id=running.ref.replica_id,
        rank=running.ref.rank,
        pid=running.pid,
        port=running.port,
        endpoint=running.endpoint,
        already_running=already_running,
    )
