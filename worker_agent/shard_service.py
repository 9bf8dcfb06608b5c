"""The node's shards: fetch weights, launch, wait until ready, watch, drain, stop.

The agent's side of the node activities, without Temporal:
``activities/agent/shards.py`` only adapts these calls (heartbeats, activity
failures). Each call takes one typed input and returns one typed result
(``llmgw.types``, as the activities carry them). A call that runs long reports
progress through the ``heartbeat`` its caller gives it and is cancelled as
asyncio cancels; what goes wrong is raised as llmgw's errors
(``llmgw/errors.py``), which the activity layer turns into what Temporal carries.

At-least-once delivery means each may run twice: launch finds a running
engine before starting one, stop is a no-op on a stopped shard, wait and
watch are pure observation.

``RunningShards`` needs only the engines' processes (the supervisor): it
watches and stops them. ``ShardService`` adds the launcher, which installs
engines, fetches weights and starts shards.
"""

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import httpx
from opentelemetry import trace

from llmgw.engine_keys import EngineKeyFn
from llmgw.errors import AgentShutdown, ConfigError, EngineExitedError, EngineNotReadyError
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
from worker_agent.engines import ReadyProbe
from worker_agent.heartbeats import FetchHeartbeat, Heartbeat, beating_while
from worker_agent.launch import LOOPBACK_KEY_PREFIX, Launcher
from worker_agent.liveness import Hung, LivenessRules, Observation, Suspect
from worker_agent.liveness_watch import LivenessWatch
from worker_agent.probes import (
    engine_busy,
    engine_load,
    liveness_probe,
    probe_liveness,
    probe_ready,
)
from worker_agent.remote_weights import fetch_pinned
from worker_agent.shard_record import ShardRecord
from worker_agent.supervisor import RunningShard, StopOutcome

log = logging.getLogger(__name__)

T = TypeVar("T")


def _staying() -> bool:
    """The default for a watch's ``leaving``: watch until the engine exits."""
    return False


class EngineProcesses(Protocol):
    """The part of the supervisor (worker_agent/supervisor.py) that watching reads and stops."""

    def find_running(self, ref: ShardRef) -> RunningShard | None: ...
    def plan_of(self, ref: ShardRef) -> ShardRecord: ...
    def dead_sidecar(self, ref: ShardRef) -> tuple[str, int] | None: ...
    def exit_code(self, ref: ShardRef) -> int | None: ...
    def stopped_on_request(self, ref: ShardRef) -> bool: ...
    def log_tail(self, ref: ShardRef, lines: int) -> list[str]: ...
    def trim_log(self, ref: ShardRef) -> bool: ...
    def stop(self, ref: ShardRef, grace_s: float) -> StopOutcome: ...
    def kill_leftovers(self, ref: ShardRef) -> list[int]: ...


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


class RunningShards:
    """Waiting for, watching, draining, stopping and reading this node's engines."""

    def __init__(
        self,
        processes: EngineProcesses,
        engine_key: EngineKeyFn,
        http: httpx.AsyncClient | None = None,
        liveness: LivenessRules | None = None,
    ) -> None:
        """``processes``: the node's supervisor; ``engine_key``: a replica's key,
        for asking its engine and for redacting it; ``http``: the client
        readiness, load and liveness checks use (closed by ``aclose``);
        ``liveness``: how a watch probes its engine (worker_agent/liveness.py;
        the defaults when None)."""
        self._sup = processes
        self._engine_key = engine_key
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._liveness = liveness or LivenessRules()

    async def aclose(self) -> None:
        """Close the HTTP client used for readiness checks."""
        await self._http.aclose()

    def _log_tail(self, ref: ShardRef, lines: int) -> list[str]:
        """The engine's last lines, its key redacted (they leave the node)."""
        return redacted(self._sup.log_tail(ref, lines), [self._engine_key(ref.replica_id)])

    async def wait_ready(self, request: WaitReadyInput, heartbeat: Heartbeat) -> WaitReadyResult:
        """Wait until the shard serves (or, for a worker rank, stays alive).

        Raises:
            EngineExitedError: the engine (or its pass-through) exited meanwhile.
            EngineNotReadyError: it did not serve within ``request.timeout_s``.
        """
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
            heartbeat(last)
            if loop.time() >= deadline:
                raise EngineNotReadyError(
                    f"not ready after {request.timeout_s:.0f}s (last: {last})"
                )
            await asyncio.sleep(request.poll_interval_s)

    async def watch(
        self,
        request: WatchShardInput,
        heartbeat: Heartbeat,
        leaving: Callable[[], bool] = _staying,
    ) -> ShardExit:
        """Return when the shard's engine exits, or once it is hung (then
        stopped); heartbeat while it runs.

        A serving shard is probed every ``liveness.interval_s`` beside the
        process checks (``LivenessWatch``); one found hung
        (worker_agent/liveness.py) is stopped, SIGKILL if need be, and
        reported with a reason starting with ``ENGINE_HUNG``, so the
        replica is replaced as when its engine exits.

        Raises:
            AgentShutdown: ``leaving()`` said the agent is stopping (asked
                each round); the engine keeps running.
        """
        ref = request.shard
        sidecar: tuple[str, int] | None = None
        hung: Hung | None = None
        probing = self._liveness_watch(ref)
        try:
            while (running := self._sup.find_running(ref)) is not None:
                if leaving():
                    # The engine outlives the agent; a retry on the next agent
                    # process resumes watching it.
                    raise AgentShutdown("agent shutting down")
                sidecar = self._sup.dead_sidecar(ref)
                if sidecar is not None:
                    # An engine nobody can reach (its pass-through is gone) is down.
                    await asyncio.to_thread(self._sup.stop, ref, 5.0)
                    break
                detail = "running"
                if probing is not None:
                    verdict = probing.step(running.endpoint)
                    if isinstance(verdict, Hung):
                        hung = verdict
                        break
                    if isinstance(verdict, Suspect):
                        detail = f"running; {verdict.detail}"
                heartbeat(detail)
                self._sup.trim_log(ref)
                await asyncio.sleep(request.poll_interval_s)
        finally:
            if probing is not None:
                await asyncio.shield(probing.aclose())
        if hung is not None and self._sup.find_running(ref) is not None:
            return await self._stop_hung(ref, hung)
        # (Found hung as it exited by itself: reported as the exit it was.)
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

    def _liveness_watch(self, ref: ShardRef) -> "LivenessWatch | None":
        """The liveness probing of ``ref``'s engine as its record describes it
        (adopted engines too); None for a worker rank, which serves no HTTP,
        or with probing off."""
        rules = self._liveness
        if rules.interval_s <= 0:
            return None
        plan = self._sup.plan_of(ref)
        if not plan.serves_http:
            return None
        key = self._engine_key(ref.replica_id)
        probe = liveness_probe(plan.engine)

        async def ask(endpoint: str) -> Observation:
            return await probe_liveness(self._http, endpoint, key, probe, rules.timeout_s)

        return LivenessWatch(rules, ask)

    async def _stop_hung(self, ref: ShardRef, hung: Hung) -> ShardExit:
        """Stop a hung engine (a stopped or wedged process ignores SIGTERM:
        the supervisor's SIGKILL ends it), and what is left of its group,
        and report why."""
        log.warning("replica %s rank %d: %s; stopping it", ref.replica_id, ref.rank, hung.reason)
        outcome = await asyncio.to_thread(self._sup.stop, ref, 5.0)
        await asyncio.to_thread(self._sup.kill_leftovers, ref)
        tail = self._log_tail(ref, 30)
        return ShardExit(exit_code=outcome.exit_code, reason=hung.reason, log_tail=tail)

    async def drain(self, request: DrainInput, heartbeat: Heartbeat) -> DrainResult:
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
            heartbeat(detail)
            await asyncio.sleep(request.poll_interval_s)

    async def load(self, request: ShardRef) -> ShardLoad:
        """Requests in flight on the shard's engine (a deployment scaling down
        drains the least loaded replica)."""
        running = self._sup.find_running(request)
        if running is None:
            return ShardLoad(in_flight=0.0, detail="not running")
        engine = self._sup.plan_of(request).engine
        key = self._engine_key(request.replica_id)
        load, detail = await engine_load(self._http, running.endpoint, key, engine)
        return ShardLoad(in_flight=load, detail=detail)

    def running(self, request: ShardRef) -> ShardRunning:
        """The shard's engine as this agent finds it (a replica whose node was
        lost asks this when the agent is back: same pid means adopted)."""
        running = self._sup.find_running(request)
        if running is not None:
            return ShardRunning(pid=running.pid)
        code = self._sup.exit_code(request)
        tail = self._log_tail(request, 30)
        reason = f"engine exited (code {code}) while its node was lost"
        return ShardRunning(pid=None, exit=ShardExit(exit_code=code, reason=reason, log_tail=tail))

    async def stop(self, request: StopShardInput) -> StopShardResult:
        """Stop the shard's process group; a no-op when it is not running."""
        outcome = await asyncio.to_thread(self._sup.stop, request.shard, request.grace_s)
        return StopShardResult(was_running=outcome.was_running, exit_code=outcome.exit_code)

    def log_tail(self, request: LogTailInput) -> LogTail:
        """The last lines the shard's engine wrote (bounded), keys redacted."""
        return LogTail(lines=self._log_tail(request.shard, request.lines))

    def _running_or_raise(self, ref: ShardRef) -> RunningShard:
        running = self._sup.find_running(ref)
        sidecar = self._sup.dead_sidecar(ref)
        if running is not None and sidecar is not None:
            tail = "\n".join(self._log_tail(ref, 20))
            raise EngineExitedError(
                f"{sidecar[0]} exited with code {sidecar[1]} while loading; log tail:\n{tail}"
            )
        if running is None:
            code = self._sup.exit_code(ref)
            tail = "\n".join(self._log_tail(ref, 20))
            raise EngineExitedError(
                f"engine exited with code {code} while loading; log tail:\n{tail}"
            )
        return running


class ShardService(RunningShards):
    """The node's shards, launching included; dependencies come through the constructor."""

    def __init__(
        self,
        launcher: Launcher,
        http: httpx.AsyncClient | None = None,
        liveness: LivenessRules | None = None,
    ) -> None:
        """``launcher``: the node's supervisor, engine installs (the one table
        of engine planners), weights cache and engine keys, and what
        launches decide; ``http``: the client readiness, load and liveness
        checks use; ``liveness``: how watches probe engines."""
        super().__init__(launcher.supervisor, launcher.engine_key, http, liveness)
        self._launcher = launcher
        self._installs = launcher.installs
        self._weights = launcher.weights

    async def stop(self, request: StopShardInput) -> StopShardResult:
        """Stop the shard, then let its remote weights be evicted once unused."""
        result = await super().stop(request)
        if self._launcher.remote is not None:
            await asyncio.to_thread(self._launcher.remote.release, request.shard.replica_id)
        return result

    async def fetch_weights(
        self, request: FetchWeightsInput, heartbeat: FetchHeartbeat
    ) -> FetchWeightsResult:
        """Bring the weights into the node's cache, verified, heartbeating progress.

        Raises:
            ConfigError: this agent has no weights cache.
            EngineInstallError: the engine the weights are for could not be installed.
            WeightsError: the fetch failed.
        """
        if self._weights is None:
            raise ConfigError("this agent has no weights cache")
        await self._ensure_engine(request.engine, request.device, heartbeat)
        if request.pin is not None:
            if self._launcher.remote is None:
                raise ConfigError("this agent has no cache for remote weights")
            return await fetch_pinned(self._launcher.remote, request, heartbeat)
        cache = self._weights
        done = [0, 0]

        def progress(copied: int, total: int) -> None:
            done[0], done[1] = copied, total  # read by the heartbeat loop below

        fetched = await beating_while(
            asyncio.to_thread(cache.fetch, request.source, request.sha256, progress),
            heartbeat,
            lambda: f"{done[0]}/{done[1]} bytes",
        )
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

    async def _ensure_engine(
        self, engine: EngineKind | None, device: str, heartbeat: Heartbeat
    ) -> None:
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
        with span:  # a step of its caller's trace (the replica start), minutes when new
            await beating_while(
                asyncio.to_thread(installs.ensure, engine, device, progress),
                heartbeat,
                lambda: last[0],
            )

    async def reserve_port(self, request: ShardRef) -> PortReservation:
        """A port for a shard that peers must know before it starts (idempotent)."""
        return await self._launcher.reserve_port(request)

    async def launch(self, request: LaunchShardInput, heartbeat: Heartbeat) -> ShardHandle:
        """Start a shard, or return the one already running for it.

        Raises:
            EngineInstallError: its engine could not be installed.
            LaunchValidationError: the engine's plan refuses the launch.
            LlmgwError: no free port, a plan that cannot be served, or a
                start that failed (EngineLaunchError and its kin).
        """
        spec = request.spec
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        async with self._launcher.shard_lock(ref):
            found = self._sup.find_running(ref)
            if found is not None:
                log.info("replica %s rank %d already running", ref.replica_id, ref.rank)
                return _handle(found, already_running=True)
            await self._ensure_engine(spec.model.engine, spec.model.profile.device, heartbeat)
            async with self._launcher.planned(spec) as launch:
                running = await beating_while(
                    asyncio.to_thread(self._launcher.start, spec, launch),
                    heartbeat,
                    lambda: "waiting for the rendezvous point",
                )
        log.info("replica %s rank %d launched pid %d", ref.replica_id, ref.rank, running.pid)
        return _handle(running, already_running=False)


def _handle(running: RunningShard, *, already_running: bool) -> ShardHandle:
    return ShardHandle(
        replica_id=running.ref.replica_id,
        rank=running.ref.rank,
        pid=running.pid,
        port=running.port,
        endpoint=running.endpoint,
        already_running=already_running,
    )
