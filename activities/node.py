"""Node activities: launch, wait-ready, watch and stop engine shards.

Served by the node agent on ``node-<id>``. At-least-once delivery means each
may run twice: launch finds a running engine before starting one, stop is a
no-op on a stopped shard, wait and watch are pure observation.
"""

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Iterable

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from llmgw.errors import (
    ConfigError,
    EngineExitedError,
    EngineLaunchError,
    EngineNotReadyError,
    LlmgwError,
)
from llmgw.types import (
    FetchWeightsInput,
    FetchWeightsResult,
    LaunchShardInput,
    LogTail,
    LogTailInput,
    ShardExit,
    ShardHandle,
    ShardRef,
    StopShardInput,
    StopShardResult,
    WaitReadyInput,
    WaitReadyResult,
    WatchShardInput,
)
from worker_agent.engines import AdapterRegistry, NodeFacts, engine_base_env
from worker_agent.supervisor import RunningShard, Supervisor
from worker_agent.weights import WeightsCache, WeightsError

log = logging.getLogger(__name__)

EngineKeyFn = Callable[[str], str]


def pick_port(host: str, candidates: Iterable[int], used: set[int]) -> int:
    """The first candidate port nobody holds (checked by binding it)."""
    for port in candidates:
        if port in used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise EngineLaunchError("no free port in the agent's engine port range")


class NodeActivities:
    """The activities of one node; dependencies come through the constructor."""

    def __init__(
        self,
        supervisor: Supervisor,
        adapters: AdapterRegistry,
        engine_key: EngineKeyFn,
        engine_host: str,
        ports: range,
        threads: int = 0,
        http: httpx.AsyncClient | None = None,
        weights: WeightsCache | None = None,
    ) -> None:
        self._sup = supervisor
        self._weights = weights
        self._adapters = adapters
        self._engine_key = engine_key
        self._host = engine_host
        self._ports = ports
        self._threads = threads
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._launch_lock = asyncio.Lock()

    async def aclose(self) -> None:
        """Close the HTTP client used for readiness checks."""
        await self._http.aclose()

    @activity.defn(name=names.FETCH_WEIGHTS)
    async def fetch_weights(self, request: FetchWeightsInput) -> FetchWeightsResult:
        """Bring the weights into the node's cache, verified, heartbeating progress."""
        if self._weights is None:
            raise ConfigError("this agent has no weights cache").to_application_error()
        cache = self._weights
        done = [0, 0]

        def progress(copied: int, total: int) -> None:
            done[0], done[1] = copied, total  # read by the heartbeat loop below

        task = asyncio.create_task(
            asyncio.to_thread(cache.fetch, request.source, request.sha256, progress)
        )
        while not task.done():
            activity.heartbeat(f"{done[0]}/{done[1]} bytes")
            await asyncio.wait({task}, timeout=1.0)
        try:
            fetched = task.result()
        except WeightsError as err:
            raise ApplicationError(
                str(err), type=type(err).__name__, non_retryable=not err.retryable
            ) from err
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

    @activity.defn(name=names.LAUNCH_SHARD)
    async def launch_shard(self, request: LaunchShardInput) -> ShardHandle:
        """Start a shard, or return the one already running for it."""
        spec = request.spec
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        # Serialised: two concurrent launches of one shard must not both miss
        # the spec file, and two shards must not pick the same port.
        async with self._launch_lock:
            found = self._sup.find_running(ref)
            if found is not None:
                log.info(
                    "replica %s rank %d already running (pid %d)",
                    ref.replica_id,
                    ref.rank,
                    found.pid,
                )
                return _handle(found, already_running=True)
            try:
                port = pick_port(self._host, self._ports, self._sup.used_ports())
                facts = NodeFacts(host=self._host, port=port, threads=self._threads)
                adapter = self._adapters.get(spec.model.engine)
                plan = adapter.plan(
                    spec, facts, self._engine_key(spec.replica_id), engine_base_env(os.environ)
                )
                running = self._sup.launch(
                    ref,
                    plan.command,
                    plan.env,
                    port=port,
                    endpoint=f"http://{self._host}:{port}",
                    spec={"shard": spec.model_dump(mode="json")},
                )
            except LlmgwError as err:
                raise err.to_application_error() from err
        log.info("replica %s rank %d launched pid %d", ref.replica_id, ref.rank, running.pid)
        return _handle(running, already_running=False)

    @activity.defn(name=names.WAIT_SHARD_READY)
    async def wait_shard_ready(self, request: WaitReadyInput) -> WaitReadyResult:
        """Wait for ``/health`` and then the model in ``/v1/models``, heartbeating."""
        ref = request.shard
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.timeout_s
        last = "not polled yet"
        while True:
            running = self._running_or_raise(ref)
            ids, last = await self._probe(running)
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
        while self._sup.find_running(ref) is not None:
            if activity.is_worker_shutdown():
                # The engine outlives the agent; a retry on the next agent
                # process resumes watching it.
                raise ApplicationError("agent shutting down", type="AgentShutdown")
            activity.heartbeat("running")
            self._sup.trim_log(ref)
            await asyncio.sleep(request.poll_interval_s)
        code = self._sup.exit_code(ref)
        tail = self._sup.log_tail(ref, 30)
        if self._sup.stopped_on_request(ref):
            # The stop raced this watch's cancellation: not a failure.
            return ShardExit(exit_code=code, reason="stopped on request", log_tail=tail)
        log.warning("replica %s rank %d engine exited (code %s)", ref.replica_id, ref.rank, code)
        return ShardExit(exit_code=code, reason=f"engine exited with code {code}", log_tail=tail)

    @activity.defn(name=names.STOP_SHARD)
    async def stop_shard(self, request: StopShardInput) -> StopShardResult:
        """Stop the shard's process group; a no-op when it is not running."""
        outcome = await asyncio.to_thread(self._sup.stop, request.shard, request.grace_s)
        return StopShardResult(was_running=outcome.was_running, exit_code=outcome.exit_code)

    @activity.defn(name=names.SHARD_LOG_TAIL)
    async def shard_log_tail(self, request: LogTailInput) -> LogTail:
        """The last lines the shard's engine wrote (bounded)."""
        return LogTail(lines=self._sup.log_tail(request.shard, request.lines))

    def _running_or_raise(self, ref: ShardRef) -> RunningShard:
        running = self._sup.find_running(ref)
        if running is None:
            code = self._sup.exit_code(ref)
            tail = "\n".join(self._sup.log_tail(ref, 20))
            raise EngineExitedError(
                f"engine exited with code {code} while loading; log tail:\n{tail}"
            ).to_application_error()
        return running

    async def _probe(self, running: RunningShard) -> tuple[list[str] | None, str]:
        headers = {"Authorization": f"Bearer {self._engine_key(running.ref.replica_id)}"}
        try:
            health = await self._http.get(f"{running.endpoint}/health", headers=headers)
            if health.status_code != 200:
                return None, f"/health {health.status_code}"
            models = await self._http.get(f"{running.endpoint}/v1/models", headers=headers)
            if models.status_code != 200:
                return None, f"/v1/models {models.status_code}"
            ids = [m["id"] for m in models.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        return (ids or None), "models listed" if ids else "no model listed"


def _handle(running: RunningShard, *, already_running: bool) -> ShardHandle:
    return ShardHandle(
        replica_id=running.ref.replica_id,
        rank=running.ref.rank,
        pid=running.pid,
        port=running.port,
        endpoint=running.endpoint,
        already_running=already_running,
    )
