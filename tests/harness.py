"""Real processes for tests: Temporal dev server, control worker, agent, router.

Everything listens on loopback, on free ports, with its state under a test
temp dir; every process is in its own group and is stopped at teardown.
Also the small builders the test folders share: node inventories, a
connection reset, polling a deployment's status.
"""

import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.agent.shards import NodeActivities
from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.store import Store
from llmgw.types import (
    DeploymentStatus,
    GpuHealth,
    GpuInfo,
    LaunchShardInput,
    ModelSpec,
    NodeInventory,
    ReplicaPhase,
    ReplicaTimeouts,
    ShardHandle,
    ShardRef,
    ShardSpec,
    StopShardInput,
    WaitReadyInput,
)
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child, wait_for
from llmgw_cli.up import kill_recorded_engines
from worker_agent.installs.installed import EngineInstalls
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.launch import Launcher
from worker_agent.shard_service import ShardService
from worker_agent.supervisor import RunningShard, Supervisor
from worker_agent.users import reachable

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# Recorded machines (sysfs trees, GPU snapshots, inventories) the tests load.
FIXTURES = TESTS / "fixtures"
DEVSERVER = REPO / "temporal-dev" / "devserver.py"
# Replica timeouts for deployments in tests: placement retried often, a short
# router grace, drains bounded.
FAST = ReplicaTimeouts(place_retry_s=0.5, place_attempts=1000, router_grace_s=0.5, drain_s=10)


def engine_cache() -> Path:
    """The engine cache the tests and their agents share (installs happen once).

    Not ``make run``'s (``.llmgw/engines``): that one sits in a work dir its
    agent makes 0710 for its own engine group, which the tests' engine users
    are not in, so a ``make test`` after ``make run`` failed on it. This one
    is the tests' alone, and nothing makes it private.
    """
    return Path(os.environ.get("LLMGW_TEST_ENGINE_CACHE", REPO / ".llmgw-test" / "engines"))


NOBODY = 65534  # a user in no group of ours, as the tests' throwaway engine users are


def agents_engine_cache() -> Path:
    """The engine cache the tests' agents are given: the tests' own
    (``engine_cache``), or, where an engine user cannot reach it (a clone under
    root's 0700 home), ``/tmp/llmgw-test-engines-<digest of the clone>``, into
    which an agent copies the install its engine user must run
    (worker_agent.installs.llamacpp ``relocated``), as the ``llama`` fixture
    does. Root's and not a link, or the tests stop here.
    """
    cache = engine_cache()
    if reachable(REPO, NOBODY, ()):
        return cache
    digest = hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
    place = Path("/tmp") / f"llmgw-test-engines-{digest}"
    place.mkdir(mode=0o755, exist_ok=True)
    info = place.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid(), f"{place} is not ours"
    place.chmod(0o755)
    return place


def free_port() -> int:
    """A port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def node_address() -> str:
    """This machine's first non-loopback IPv4 address (``hostname -I``), or loopback."""
    try:
        out = subprocess.run(
            ["hostname", "-I"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "127.0.0.1"
    for addr in out.split():
        if "." in addr and not addr.startswith("127."):
            return addr
    return "127.0.0.1"


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST, not FIN: the peer's next read fails with ECONNRESET."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def start_devserver(db: Path, port: int, log: Path, namespaces: Sequence[str] = ()) -> Child:
    """A headless Temporal dev server on ``port`` with state in ``db``
    (and ``namespaces`` created besides ``default``)."""
    argv = [sys.executable, str(DEVSERVER), "--db", str(db), "--port", str(port), "--headless"]
    argv += [arg for ns in namespaces for arg in ("--namespace", ns)]
    child = Child("temporal", argv, os.environ, log)
    if not wait_for(lambda: port_open(port) or not child.alive(), 30):
        child.stop()
        raise RuntimeError("Temporal dev server did not start")
    return child


@contextlib.contextmanager
def devserver(root: Path) -> Iterator[str]:
    """A dev server with its state and log under ``root``: its address, stopped after."""
    port = free_port()
    server = start_devserver(root / "temporal.db", port, root / "temporal.log")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


class System:
    """The llmgw processes of one test, sharing a Temporal server and a store."""

    def __init__(
        self,
        temporal_address: str,
        work_dir: Path,
        engine_port_start: int,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """``extra_env`` goes to every process (Temporal TLS settings, say)."""
        self.work_dir = work_dir
        self.store_url = f"sqlite:///{work_dir / 'llmgw.db'}"
        self.env = dict(os.environ)
        self.env.update(
            {
                "LLMGW_TEMPORAL_ADDRESS": temporal_address,
                "LLMGW_WORK_DIR": str(work_dir),
                "LLMGW_STORE_URL": self.store_url,
                "LLMGW_PORT_RANGE_START": str(engine_port_start),
                "LLMGW_PORT_RANGE_END": str(engine_port_start + 99),
                "LLMGW_REFRESH_INTERVAL_S": "0.2",
                "LLMGW_ENGINE_THREADS": "1",
                # A crash in native code leaves its Python stack in the log.
                "PYTHONFAULTHANDLER": "1",
                # Most tests deploy models they never put in the catalog.
                "LLMGW_RECONCILE_CATALOG": "false",
                # Their models and work dirs sit under pytest's 0700 temp dir,
                # which no engine user can reach: engines run as root, as the
                # operator may allow. tests/agent/test_engine_user.py and
                # tests/e2e/test_engine_user_agent.py test the default.
                "LLMGW_ALLOW_ROOT_ENGINES": "true",
                # Nor is a system dir made for them (/var/lib/llmgw, one per
                # work dir): test_engine_user_agent.py tests that.
                "LLMGW_SYSTEM_DIR": "",
                # Test models are generated under pytest's temp dirs.
                "LLMGW_WEIGHTS_ROOTS": str(Path(tempfile.gettempdir()).resolve()),
                "LLMGW_ENGINE_CACHE_DIR": str(agents_engine_cache()),
            }
        )
        self.env.update(extra_env or {})
        self.children: list[Child] = []

    def cli(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        """Run ``llmgw <args>`` against this system, its output captured (blocking)."""
        return subprocess.run(
            [sys.executable, "-m", "llmgw_cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def spawn(self, name: str, extra_env: dict[str, str] | None = None) -> Child:
        """Start ``llmgw <name>`` as a child process."""
        env = dict(self.env, **(extra_env or {}))
        log = self.work_dir / "logs" / f"{name}-{len(self.children)}.log"
        child = Child(name, [sys.executable, "-m", "llmgw_cli", name], env, log)
        self.children.append(child)
        return child

    def catalog(self, *specs: ModelSpec) -> str:
        """Put ``specs`` in the store's catalog; returns a new client API key."""
        store = Store(self.store_url)
        try:
            store.migrate()
            for spec in specs:
                store.put_model(spec)
            return store.create_api_key("test")
        finally:
            store.close()

    def spawn_agent(self, node_id: str, extra_env: dict[str, str] | None = None) -> Child:
        """An agent with its own port range, as if on its own machine."""
        start = free_port()
        return self.spawn(
            "agent",
            {
                "LLMGW_NODE_ID": node_id,
                "LLMGW_PORT_RANGE_START": str(start),
                "LLMGW_PORT_RANGE_END": str(start + 20),
                **(extra_env or {}),
            },
        )

    def start_router(self, port: int, env: dict[str, str] | None = None) -> Child:
        """The router on ``port`` (``env``: more of its settings), once it accepts connections."""
        child = self.spawn("router", {"LLMGW_PORT": str(port), **(env or {})})
        if not wait_for(lambda: port_open(port) or not child.alive(), 60):
            raise RuntimeError(f"router did not start:\n{child.log_tail()}")
        if not child.alive():
            raise RuntimeError(f"router exited:\n{child.log_tail()}")
        return child

    async def start(
        self,
        client: Client,
        *nodes: str,
        agent_env: dict[str, str] | None = None,
        own_ports: bool = False,
    ) -> "Started":
        """The whole spine: the control worker, an agent per node in ``nodes``,
        the router on a free port, returning once every node has registered.
        ``own_ports`` gives each agent its own port range (``spawn_agent``),
        as if on its own machine; otherwise they share the system's."""
        self.spawn("control")
        agents = [
            self.spawn_agent(node, agent_env)
            if own_ports
            else self.spawn("agent", {"LLMGW_NODE_ID": node, **(agent_env or {})})
            for node in nodes
        ]
        port = free_port()
        self.start_router(port)
        for node in nodes:
            await replicas.wait_node_registered(client, node, 60)
        return Started(port, agents)

    def stop(self) -> None:
        """Stop every process this system started.

        A child already gone gets its exit status appended to its log (a
        signal shows as -N): a process that died unseen writes nothing else.
        """
        for child in reversed(self.children):
            code = child.exit_code()
            if code is not None:
                with open(child.log_path, "a") as log:
                    log.write(f"--- {child.name} exited with {code} before the teardown\n")
            child.stop(grace_s=10)
        # A failed test must not leave engines running into the next one.
        kill_recorded_engines(self.work_dir / "agent")


@dataclass(frozen=True)
class Started:
    """What ``System.start`` brought up: the router's port and the agents."""

    port: int
    agents: list[Child]

    @property
    def root(self) -> str:
        """The router's address."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base(self) -> str:
        """The router's OpenAI base URL."""
        return f"{self.root}/v1"


async def wait_routable(base_url: str, key: str, model: str, timeout_s: float = 30) -> None:
    """Wait until the router's background refresh has the model's replicas."""
    async with httpx.AsyncClient() as http, asyncio.timeout(timeout_s):
        while True:
            r = await http.get(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 200 and model in [m["id"] for m in r.json()["data"]]:
                return
            await asyncio.sleep(0.05)


async def wait_deployment(
    client: Client, model: str, ok: Callable[[DeploymentStatus], bool], timeout_s: float = 120
) -> DeploymentStatus:
    """Poll the deployment's status until ``ok`` holds for it."""
    async with asyncio.timeout(timeout_s):
        while True:
            status = await replicas.deployment_status(client, model)
            if ok(status):
                return status
            await asyncio.sleep(0.2)


async def wait_phase(client: Client, rid: str, phase: ReplicaPhase, timeout_s: float) -> float:
    """Seconds until the replica's memo shows ``phase``."""
    began = asyncio.get_running_loop().time()
    async with asyncio.timeout(timeout_s):
        while True:
            memo = await replicas.replica_memo(client, rid)
            if memo is not None and memo.phase is phase:
                return asyncio.get_running_loop().time() - began
            await asyncio.sleep(0.1)


def cpu_inventory(node_id: str = "test-node") -> NodeInventory:
    """A GPU-less node on loopback, as the agent would report this machine."""
    return NodeInventory(
        node_id=node_id, hostname=node_id, address="127.0.0.1", cpu_count=2, memory_mib=1024
    )


def node_inventory(
    node_id: str, gpus: int = 0, cpu_slots: int = 4, unhealthy: tuple[int, ...] = ()
) -> NodeInventory:
    """A node for the pure placement rules: ``gpus`` H100s (those in ``unhealthy``
    with an uncorrected ECC error) and ``cpu_slots`` CPU replicas."""
    return NodeInventory(
        node_id=node_id,
        hostname=node_id,
        address="127.0.0.1",
        cpu_count=8,
        memory_mib=1024,
        max_cpu_replicas=cpu_slots,
        gpus=[
            GpuInfo(
                index=i,
                uuid=f"GPU-{node_id}-{i}",
                name="H100",
                memory_mib=81559,
                health_flags=[GpuHealth.ECC_UNCORRECTED] if i in unhealthy else [],
            )
            for i in range(gpus)
        ],
    )


def llama_only(llama: LlamaCppInstall, work: Path) -> EngineInstalls:
    """A node's engines with llama.cpp installed and an empty cache for the rest."""
    return EngineInstalls(work / "engines", llama)


def node_activities(
    llama: LlamaCppInstall, supervisor: Supervisor, secret: str = "test-secret"
) -> NodeActivities:
    """Node activities over real llama.cpp binaries, on a fresh port range."""
    start = free_port()
    return NodeActivities(
        ShardService(
            Launcher(
                supervisor=supervisor,
                installs=llama_only(llama, supervisor.work_dir),
                engine_key=lambda rid: engine_key(secret, rid),
                engine_host="127.0.0.1",
                ports=range(start, start + 50),
                inventory=cpu_inventory,
                threads=1,
            )
        )
    )


def readable_model(tiny: TinyModel, where: Path) -> Path:
    """A copy of the tiny model in ``where`` that every user may read (an engine
    user's engine among them)."""
    model = where / "tiny.gguf"
    shutil.copy(tiny.model_path, model)
    model.chmod(0o644)
    return model


@contextlib.asynccontextmanager
async def ready_shard(
    llama: LlamaCppInstall, supervisor: Supervisor, spec: ShardSpec, secret: str = "test-secret"
) -> AsyncIterator[tuple[RunningShard, ShardHandle]]:
    """``spec`` launched through real node activities over ``supervisor``, and
    ready: its running engine and the launch's handle. Stopped afterwards."""
    acts = node_activities(llama, supervisor, secret=secret)
    env = ActivityEnvironment()
    ref = ShardRef(replica_id=spec.replica_id)
    handle = await env.run(acts.launch_shard, LaunchShardInput(spec=spec))
    try:
        await env.run(acts.wait_shard_ready, WaitReadyInput(shard=ref, timeout_s=60))
        running = supervisor.find_running(ref)
        assert running is not None
        yield running, handle
    finally:
        await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
        await acts.aclose()
