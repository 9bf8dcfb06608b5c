"""Node activities: launch, wait-ready, watch and stop engine shards.

Served by the node agent on ``node-<id>``. At-least-once delivery means each
may run twice: launch finds a running engine before starting one, stop is a
no-op on a stopped shard, wait and watch are pure observation.
"""

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
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
    NodeInventory,
    PortReservation,
    ShardExit,
    ShardHandle,
    ShardLoad,
    ShardRef,
    ShardRunning,
    ShardSpec,
    StopShardInput,
    StopShardResult,
    WaitReadyInput,
    WaitReadyResult,
    WatchShardInput,
)
from worker_agent import passthrough
from worker_agent.cpu_share import (
    NOBIND,
    choose_binding,
    cores_per_engine,
    format_cpu_list,
    kv_cache_bytes,
    parse_cpu_list,
)
from worker_agent.engines import (
    CommandSpec,
    EnginePlanner,
    LaunchValidationError,
    LoraAdapter,
    ReadyProbe,
    ShardPlan,
    ShardRequest,
    node_facts,
    plan_shard,
)
from worker_agent.installs.installed import EngineInstalls
from worker_agent.installs.llamacpp import EngineInstallError
from worker_agent.launching import (
    engine_busy,
    engine_env,
    engine_load,
    pick_port,
    probe_ready,
    wait_listening,
)
from worker_agent.shard_record import ShardRecord
from worker_agent.supervisor import Command, RunningShard, Supervisor, shard_key
from worker_agent.weights import WeightsCache, WeightsError

log = logging.getLogger(__name__)

EngineKeyFn = Callable[[str], str]
# Engines listen here only; the node's address is the pass-through's.
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class _Launch:
    """A planned shard with the ports and cores the agent gave it."""

    plan: ShardPlan
    port: int  # published: the pass-through's, or the shard's own when not fronted
    internal_port: int | None  # the engine's loopback HTTP port behind the pass-through
    key: str
    bind: str  # VLLM_CPU_OMP_THREADS_BIND, "" when not bound


T = TypeVar("T")


async def _heartbeat_while(work: Awaitable[T], detail: Callable[[], str]) -> T:
    """Await blocking work run in a thread, heartbeating every second meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        activity.heartbeat(detail())
        await asyncio.wait({task}, timeout=1.0)
    return task.result()


class NodeActivities:
    """The activities of one node; dependencies come through the constructor."""

    def __init__(
        self,
        supervisor: Supervisor,
        planners: Mapping[EngineKind, EnginePlanner],
        engine_key: EngineKeyFn,
        engine_host: str,
        ports: range,
        inventory: Callable[[], NodeInventory],
        threads: int = 0,
        http: httpx.AsyncClient | None = None,
        weights: WeightsCache | None = None,
        installs: EngineInstalls | None = None,
        cpu_kv_cache_mib: int = 0,
        cores: Sequence[int] | None = None,
    ) -> None:
        self._sup = supervisor
        self._installs = installs
        self._kv_mib = cpu_kv_cache_mib
        self._cores = list(cores) if cores is not None else sorted(os.sched_getaffinity(0))
        # Cores promised to launches whose spec file is not written yet.
        self._binding: dict[str, set[int]] = {}
        self._weights = weights
        self._inventory = inventory
        self._planners = planners
        self._engine_key = engine_key
        self._host = engine_host
        self._ports = ports
        self._threads = threads
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        # Per shard: two launches of one shard must not both miss its spec
        # file. One port lock: two shards must not take the same port.
        self._shard_locks: dict[str, asyncio.Lock] = {}
        self._port_lock = asyncio.Lock()
        self._reserved: set[int] = set()

    async def aclose(self) -> None:
        """Close the HTTP client used for readiness checks."""
        await self._http.aclose()

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
        if self._installs is None or engine is None:
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
        record = self._sup.shard_dir(ref) / "reserved-port"
        async with self._port_lock:
            if record.exists():
                port = int(record.read_text())
            else:
                port = self._take_port()
                record.parent.mkdir(parents=True, exist_ok=True)
                record.write_text(str(port))
        return PortReservation(host=self._host, port=port)

    @activity.defn(name=names.LAUNCH_SHARD)
    async def launch_shard(self, request: LaunchShardInput) -> ShardHandle:
        """Start a shard, or return the one already running for it."""
        spec = request.spec
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        lock = self._shard_locks.setdefault(f"{ref.replica_id}/{ref.rank}", asyncio.Lock())
        async with lock:
            found = self._sup.find_running(ref)
            if found is not None:
                log.info("replica %s rank %d already running", ref.replica_id, ref.rank)
                return _handle(found, already_running=True)
            await self._ensure_engine(spec.model.engine, spec.model.profile.device)
            ports: list[int] = []
            try:
                async with self._port_lock:
                    ports.append(spec.port or self._take_port())
                    if spec.rank == 0:  # the engine's own, loopback-only HTTP port
                        ports.append(self._take_port(LOOPBACK))
                    bind = self._bind_cores(ref, spec)
                launch = self._plan(spec, ports, bind)
                running = await _heartbeat_while(
                    asyncio.to_thread(self._start, ref, spec, launch),
                    lambda: "waiting for the rendezvous point",
                )
            except LaunchValidationError as err:
                raise ConfigError(str(err)).to_application_error() from err
            except LlmgwError as err:
                raise err.to_application_error() from err
            finally:
                # Recorded in the spec file once launched; released if not.
                self._reserved.difference_update(ports)
                self._binding.pop(shard_key(ref), None)
        log.info("replica %s rank %d launched pid %d", ref.replica_id, ref.rank, running.pid)
        return _handle(running, already_running=False)

    def _take_port(self, host: str = "") -> int:
        used = self._sup.used_ports() | self._reserved
        port = pick_port(host or self._host, self._ports, used)
        self._reserved.add(port)
        return port

    def _bind_cores(self, ref: ShardRef, spec: ShardSpec) -> str:
        """Cores of their own for a vLLM CPU engine; ``""`` for every other shard."""
        model = spec.model
        if model.engine is not EngineKind.VLLM or model.profile.device != "cpu":
            return ""
        taken = set().union(*self._binding.values())
        for running in self._sup.running():
            taken |= parse_cpu_list(self._sup.plan_of(running.ref).cpu_bind)
        inv = self._inventory()
        per_rank = cores_per_engine(len(self._cores), inv.max_cpu_replicas, self._threads)
        bind = choose_binding(self._cores, taken, per_rank, model.profile.tp)
        if bind == NOBIND:
            log.warning(
                "replica %s: no %d free cores to bind (held: %s): its threads run unbound",
                ref.replica_id,
                per_rank * model.profile.tp,
                format_cpu_list(taken) or "none",
            )
        self._binding[shard_key(ref)] = parse_cpu_list(bind)
        return bind

    def _adapter_path(self, source: str) -> str:
        """A catalog adapter's file, resolved inside the weights roots as the
        model's weights are (SourceOutsideRoots if not); the engine gets the
        resolved path, so a link swapped in later cannot lead it out."""
        if self._weights is None:
            return source
        return str(self._weights.roots.inside(source))

    def _plan(self, spec: ShardSpec, ports: list[int], bind: str) -> _Launch:
        fronted = len(ports) > 1
        inv = self._inventory()
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        facts = node_facts(
            inv, spec.gpu_indices, ports[-1], host=self._host, threads=self._threads
        ).model_copy(
            update={
                "http_host": LOOPBACK if fronted else "",
                "cpu_threads_bind": bind or NOBIND,
                "kv_cache_bytes": kv_cache_bytes(
                    inv.memory_mib, inv.max_cpu_replicas, self._kv_mib
                ),
                "scratch_dir": str(self._sup.scratch_dir(ref)),
            }
        )
        static = () if spec.model.profile.runtime_lora else spec.model.adapters
        request = ShardRequest(
            model=spec.model,
            profile=spec.model.profile,
            rank=spec.rank,
            node=facts,
            rendezvous=spec.rendezvous,
            # Catalog adapters only, loaded at start; on-demand ones come
            # through AdapterLoad (never a path a client supplied).
            loras=tuple(
                LoraAdapter(name=a.name, path=self._adapter_path(a.source)) for a in static
            ),
        )
        key = self._engine_key(spec.replica_id)
        planners = (
            self._installs.planners(spec.model.profile.device) if self._installs else self._planners
        )
        plan = plan_shard(request, key, engine_env(os.environ), planners)
        if plan.serves_http and not fronted:
            raise ConfigError(f"rank {spec.rank} serves HTTP but only rank 0 is fronted")
        return _Launch(
            plan=plan,
            port=ports[0],
            internal_port=ports[-1] if fronted else None,
            key=key,
            bind=bind,
        )

    def _start(self, ref: ShardRef, spec: ShardSpec, launch: _Launch) -> RunningShard:
        plan, port = launch.plan, launch.port
        specs = list(plan.commands)
        commands = [Command(list(c.argv), {**plan.env, **c.env}) for c in specs]
        if plan.serves_http and launch.internal_port is not None:
            # First, so it leads the process group: one signal stops it with the engine.
            upstream = f"http://{LOOPBACK}:{launch.internal_port}"
            env = {**engine_env(os.environ), passthrough.KEY_ENV: launch.key}
            argv = passthrough.command(sys.executable, self._host, port, upstream)
            commands.insert(0, Command(argv, env, drops_privileges=True))
            specs.insert(0, CommandSpec(name="passthrough", argv=tuple(argv)))
        endpoint = f"http://{self._host}:{port}" if plan.serves_http else f"{self._host}:{port}"
        record = ShardRecord(
            model=spec.model.name,
            engine=spec.model.engine.value,
            gpu_indices=spec.gpu_indices,
            priority=spec.model.priority,
            catalog_digest=spec.catalog_digest,
            serves_http=plan.serves_http,
            ready_probe=plan.ready_probe,
            plan=plan.loggable(),
            internal_port=launch.internal_port,
            cpu_bind=launch.bind,
        )
        return self._sup.launch(
            ref,
            commands,
            port,
            endpoint,
            record,
            before_each=lambda i: wait_listening(specs[i].wait_for),
        )

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
        tail = self._sup.log_tail(ref, 30)
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
        tail = self._sup.log_tail(request, 30)
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
        return LogTail(lines=self._sup.log_tail(request.shard, request.lines))

    def _running_or_raise(self, ref: ShardRef) -> RunningShard:
        running = self._sup.find_running(ref)
        sidecar = self._sup.dead_sidecar(ref)
        if running is not None and sidecar is not None:
            tail = "\n".join(self._sup.log_tail(ref, 20))
            raise EngineExitedError(
                f"{sidecar[0]} exited with code {sidecar[1]} while loading; log tail:\n{tail}"
            ).to_application_error()
        if running is None:
            code = self._sup.exit_code(ref)
            tail = "\n".join(self._sup.log_tail(ref, 20))
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
