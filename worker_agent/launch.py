"""Launching a shard on this node: the ports and cores it gets, its plan, the
pass-through in front of its engine, and the record the supervisor keeps.

``ShardService.launch`` (``worker_agent/shard_service.py``) drives this
module: it finds a running engine, installs the engine and heartbeats, and
the ``launch_shard`` activity (``activities/agent/shards.py``) turns its
errors into activity failures; every decision is made here.
Nothing here needs Temporal, so each part can be tested without it.
"""

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.engine_keys import EngineKeyFn
from llmgw.errors import ConfigError, EngineLaunchError
from llmgw.types import EngineKind, NodeInventory, PortReservation, ShardRef, ShardSpec
from worker_agent import cpu_share, passthrough
from worker_agent.engines import (
    CommandSpec,
    Endpoint,
    LoraAdapter,
    ShardPlan,
    ShardRequest,
    node_facts,
    plan_shard,
)
from worker_agent.installs.installed import EngineInstalls
from worker_agent.remote_weights import RemoteWeights
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import RunningShard, Supervisor, shard_key
from worker_agent.weights import WeightsCache

log = logging.getLogger(__name__)

# Engines listen here only; the node's address is the pass-through's.
LOOPBACK = "127.0.0.1"

# What an engine may inherit from the agent's environment. An allow-list,
# not a deny-list: the agent's environment holds secrets under any name
# (PGPASSWORD, AWS_*, HF_TOKEN, OTEL_EXPORTER_OTLP_HEADERS, LLMGW_*...), and
# an engine needs only these. Plans add what else they decide (keys, GPUs,
# fabric, TMPDIR), and the supervisor sets HOME/USER/XDG_CACHE_HOME for the
# engine user.
ENGINE_ENV_NAMES = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "HOME",
        "USER",
        "LOGNAME",
        "LD_LIBRARY_PATH",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    }
)
ENGINE_ENV_PREFIXES = (
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "GLOO_",
    "UCX_",
    "OMP_",
    "KMP_",
    "MKL_",
    "ROCR_",
    "HIP_",
    "HSA_",
    "VLLM_",
    "SGLANG_",
    "TORCH_",
    "PYTORCH_",
    "TRITON_",
    "GGML_",
)
# Inside an allowed prefix but a credential or a setting the plan owns.
_ENGINE_ENV_DENIED_SUFFIXES = ("_KEY", "_TOKEN", "_SECRET", "_PASSWORD")


def engine_env(agent_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the agent's environment an engine (or pass-through) may see."""
    return {
        k: v
        for k, v in agent_env.items()
        if (k in ENGINE_ENV_NAMES or k.startswith(ENGINE_ENV_PREFIXES))
        and not k.endswith(_ENGINE_ENV_DENIED_SUFFIXES)
    }


def pick_port(host: str, candidates: Iterable[int], used: set[int]) -> int:
    """The first candidate port nobody holds (checked by binding it)."""
    for port in candidates:
        if port in used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As the engines bind: connections an engine on this port closed
            # linger in TIME_WAIT for a minute, and without SO_REUSEADDR they
            # would make a free port look taken (a busy node ran out of ports).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise EngineLaunchError("no free port in the agent's engine port range")


def listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_listening(endpoints: Iterable[Endpoint], poll_s: float = 0.2) -> None:
    """Block until every endpoint listens; past its bound, fail instead of hanging."""
    for ep in endpoints:
        deadline = time.monotonic() + ep.timeout_s
        while not listening(ep.host, ep.port):
            if time.monotonic() > deadline:
                raise EngineLaunchError(
                    f"rendezvous point {ep.host}:{ep.port} not listening after {ep.timeout_s:.0f}s"
                )
            time.sleep(poll_s)


@dataclass(frozen=True)
class Launch:
    """A planned shard with the ports and cores the agent gave it."""

    plan: ShardPlan
    port: int  # published: the pass-through's, or the shard's own when not fronted
    internal_port: int | None  # the engine's loopback HTTP port behind the pass-through
    key: str  # the replica's: only the pass-through holds it
    bind: str  # VLLM_CPU_OMP_THREADS_BIND, "" when not bound
    # The engine's own, for its loopback port only: every engine runs as one
    # user and can read another's environ and argv (worker_agent/passthrough.py).
    engine_key: str = ""
    # The pass-through opens an engine connection per request, keeping none
    # alive (worker_agent/passthrough.py PassThrough): for ``NO_KEEPALIVE`` engines.
    close_engine_connections: bool = False


# Engines the pass-through keeps no connection alive to: llama-server's HTTP
# server (cpp-httplib) holds a thread with each kept-alive connection for up to
# 5 s, which a wake's burst could queue behind (issue 23 item 13). vLLM's and
# SGLang's (uvicorn) have no such limit: they keep the pooled connections,
# which spare each request a connect (0.2-0.4 ms).
NO_KEEPALIVE = frozenset({EngineKind.LLAMA_CPP})


# An engine's own loopback key: the prefix lets a log tail's redaction
# (worker_agent/shard_service.py) find it exactly, as the agent does not keep it.
LOOPBACK_KEY_PREFIX = "llmgw-loop-"


def new_loopback_key() -> str:
    """A fresh loopback key: ``LOOPBACK_KEY_PREFIX`` and 64 hex digits."""
    return LOOPBACK_KEY_PREFIX + secrets.token_hex(32)


class Launcher:
    """Plans and starts the shards of one node; dependencies come through the constructor."""

    def __init__(
        self,
        supervisor: Supervisor,
        installs: EngineInstalls,
        engine_key: EngineKeyFn,
        engine_host: str,
        ports: range,
        inventory: Callable[[], NodeInventory],
        threads: int = 0,
        weights: WeightsCache | None = None,
        cpu_kv_cache_mib: int = 0,
        remote: RemoteWeights | None = None,
        cores: Sequence[int] | None = None,
    ) -> None:
        # Read by the node's activities too (watching, draining, installing).
        self.supervisor = supervisor
        self.installs = installs
        self.engine_key = engine_key
        self.weights = weights
        self.remote = remote  # pinned remote sources (worker_agent/remote_weights.py)
        self._host = engine_host
        self._ports = ports
        self._inventory = inventory
        self._threads = threads
        self._kv_mib = cpu_kv_cache_mib
        self._cores = list(cores) if cores is not None else sorted(os.sched_getaffinity(0))
        # Cores promised to launches whose spec file is not written yet.
        self._binding: dict[str, set[int]] = {}
        # Per shard: two launches of one shard must not both miss its spec
        # file. One port lock: two shards must not take the same port.
        self._shard_locks: dict[str, asyncio.Lock] = {}
        self._port_lock = asyncio.Lock()
        self._reserved: set[int] = set()

    def shard_lock(self, ref: ShardRef) -> asyncio.Lock:
        """Held while a shard is found or launched, so one shard gets one engine."""
        return self._shard_locks.setdefault(f"{ref.replica_id}/{ref.rank}", asyncio.Lock())

    async def reserve_port(self, ref: ShardRef) -> PortReservation:
        """A port for a shard that peers must know before it starts (idempotent)."""
        record = self.supervisor.shard_dir(ref) / "reserved-port"
        async with self._port_lock:
            if record.exists():
                port = int(record.read_text())
            else:
                port = self._take_port()
                record.parent.mkdir(parents=True, exist_ok=True)
                record.write_text(str(port))
        return PortReservation(host=self._host, port=port)

    @contextlib.asynccontextmanager
    async def planned(self, spec: ShardSpec) -> AsyncIterator[Launch]:
        """The shard's plan with its ports and cores, held for it until the block ends.

        Raises:
            LaunchValidationError: the engine's plan refuses the launch.
            LlmgwError: no free port, or a plan that cannot be served.
        """
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        ports: list[int] = []
        try:
            async with self._port_lock:
                ports.append(spec.port or self._take_port())
                if spec.rank == 0:  # the engine's own, loopback-only HTTP port
                    ports.append(self._take_port(LOOPBACK))
                bind = self._bind_cores(ref, spec)
            yield self._plan(spec, ports, bind)
        finally:
            # Recorded in the spec file once launched; released if not.
            self._reserved.difference_update(ports)
            self._binding.pop(shard_key(ref), None)

    def _take_port(self, host: str = "") -> int:
        used = self.supervisor.used_ports() | self._reserved
        port = pick_port(host or self._host, self._ports, used)
        self._reserved.add(port)
        return port

    def _bind_cores(self, ref: ShardRef, spec: ShardSpec) -> str:
        """Cores of their own for a vLLM CPU engine; ``""`` for every other shard."""
        model = spec.model
        if model.engine is not EngineKind.VLLM or model.profile.device != "cpu":
            return ""
        taken = set().union(*self._binding.values())
        for running in self.supervisor.running():
            taken |= cpu_share.parse_cpu_list(self.supervisor.plan_of(running.ref).cpu_bind)
        inv = self._inventory()
        per_rank = cpu_share.cores_per_engine(len(self._cores), inv.max_cpu_replicas, self._threads)
        bind = cpu_share.choose_binding(self._cores, taken, per_rank, model.profile.tp)
        if bind == cpu_share.NOBIND:
            log.warning(
                "replica %s: no %d free cores to bind (held: %s): its threads run unbound",
                ref.replica_id,
                per_rank * model.profile.tp,
                cpu_share.format_cpu_list(taken) or "none",
            )
        self._binding[shard_key(ref)] = cpu_share.parse_cpu_list(bind)
        return bind

    def _adapter_path(self, source: str) -> str:
        """A catalog adapter's file, resolved inside the weights roots as the
        model's weights are (SourceOutsideRoots if not); the engine gets the
        resolved path, so a link swapped in later cannot lead it out."""
        if self.weights is None:
            return source
        return str(self.weights.roots.inside(source))

    def _plan(self, spec: ShardSpec, ports: list[int], bind: str) -> Launch:
        fronted = len(ports) > 1
        inv = self._inventory()
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        facts = node_facts(
            inv, spec.gpu_indices, ports[-1], host=self._host, threads=self._threads
        ).model_copy(
            update={
                "http_host": LOOPBACK if fronted else "",
                "cpu_threads_bind": bind or cpu_share.NOBIND,
                "kv_cache_bytes": cpu_share.kv_cache_bytes(
                    inv.memory_mib, inv.max_cpu_replicas, self._kv_mib
                ),
                "scratch_dir": str(self.supervisor.scratch_dir(ref)),
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
        key = self.engine_key(spec.replica_id)
        loopback_key = new_loopback_key()
        planners = self.installs.planners(spec.model.profile.device)
        plan = plan_shard(request, loopback_key, engine_env(os.environ), planners)
        if plan.serves_http and not fronted:
            raise ConfigError(f"rank {spec.rank} serves HTTP but only rank 0 is fronted")
        return Launch(
            plan=plan,
            port=ports[0],
            internal_port=ports[-1] if fronted else None,
            key=key,
            bind=bind,
            engine_key=loopback_key,
            close_engine_connections=spec.model.engine in NO_KEEPALIVE,
        )

    def start(self, spec: ShardSpec, launch: Launch) -> RunningShard:
        """Start the planned shard, its pass-through first (blocking: it waits
        for the plan's rendezvous points)."""
        ref = ShardRef(replica_id=spec.replica_id, rank=spec.rank)
        plan, port = launch.plan, launch.port
        specs = list(plan.commands)
        commands = [Command(list(c.argv), {**plan.env, **c.env}) for c in specs]
        if plan.serves_http and launch.internal_port is not None:
            # First, so it leads the process group: one signal stops it with the engine.
            upstream = f"http://{LOOPBACK}:{launch.internal_port}"
            keys = passthrough.keys_input(launch.key, launch.engine_key or launch.key)
            argv = passthrough.command(
                sys.executable, self._host, port, upstream, launch.close_engine_connections
            )
            commands.insert(
                0, Command(argv, engine_env(os.environ), drops_privileges=True, stdin_secret=keys)
            )
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
            endpoint_proofs=True,
        )
        return self.supervisor.launch(
            ref,
            commands,
            port,
            endpoint,
            record,
            before_each=lambda i: wait_listening(specs[i].wait_for),
        )
