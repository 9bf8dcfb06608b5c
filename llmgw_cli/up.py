"""``llmgw up``: the whole system on this machine, stopped cleanly on Ctrl-C.

Order on the way up: Temporal dev server → control worker → node agent →
router → the default model's replica → one real completion through the
router. Only then is the endpoint printed. Once all four processes run, one
that dies is started again after a backoff (1 s doubling to 30 s), and the
console says so; a restarted agent adopts the engines that kept running.

One ``llmgw up`` per work dir: a second one finds the first's lock
(``up.lock``, held with flock for the first's lifetime) and exits saying so
before it starts, stops or kills anything - its shutdown would otherwise
kill the running instance's engines as leftovers.

On SIGINT/SIGTERM the replicas are stopped through their workflows (so
engines exit the normal way and GPUs are released in the ledger), then the
processes in reverse order, and finally any engine still recorded in the
agent's spec files is killed as a safety net. The whole of it is bounded by
``shutdown_timeout_s``: a Temporal server that does not answer gets a share
of it, and a process still running at the end is killed.
"""

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
from temporalio.client import Client, WorkflowFailureError
from temporalio.service import RPCError

from llmgw import replicas
from llmgw.errors import InstanceRunningError, LlmgwError
from llmgw.lifecycle import stop_event_on_signals, unless_stopped
from llmgw.settings import UpSettings
from llmgw.store import Store
from llmgw.temporal import connect
from llmgw.types import EngineKind, ModelSpec, ReplicaMemo
from llmgw_cli.dev.tinymodel import generate_tiny_model
from llmgw_cli.procs import Child, Supervised, log_tail, wait_for
from worker_agent import procfs
from worker_agent.installs.llamacpp import ensure_llama_cpp
from worker_agent.shard_record import SpecFile

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVSERVER = REPO_ROOT / "temporal-dev" / "devserver.py"

Say = Callable[[str], None]
Announce = Callable[[str, str, str], None]
# Of the shutdown bound, what the processes and engines are left after
# replicas are stopped through Temporal (each process needs about a second).
PROCESS_STOP_RESERVE_S = 4.0
# A Temporal server that does not answer this fast is not asked to drain.
TEMPORAL_CHECK_S = 1.0
# How often the supervisor looks for a child that died.
CHECK_INTERVAL_S = 0.2


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on host:port."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def child_env(settings: UpSettings) -> dict[str, str]:
    """The environment every child runs with: the settings, spelled as LLMGW_*."""
    # Its Temporal is the plain dev server it started on loopback: namespace,
    # TLS and API key meant for a cluster (LLMGW_TEMPORAL_*) do not apply.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_TEMPORAL_")}
    env.update(
        {
            "LLMGW_TEMPORAL_ADDRESS": f"127.0.0.1:{settings.temporal_port}",
            "LLMGW_WORK_DIR": str(settings.work_dir.resolve()),
            "LLMGW_STORE_URL": settings.resolved_store_url(),
            "LLMGW_PORT": str(settings.router_port),
            # The control worker's job activities send batch lines here.
            "LLMGW_ROUTER_URLS": f"http://127.0.0.1:{settings.router_port}",
            "LLMGW_PORT_RANGE_START": str(settings.port_range_start),
            "LLMGW_PORT_RANGE_END": str(settings.port_range_start + 999),
            "LLMGW_LOG_LEVEL": settings.log_level,
            "LLMGW_NODE_ID": settings.node_id,
            "LLMGW_ENGINE_CACHE_DIR": str(settings.resolved_engine_cache_dir()),
        }
    )
    return env


def dev_api_key(store: Store, path: Path) -> str:
    """The development key: reused from ``path`` while valid, else made anew."""
    if path.exists():
        key = path.read_text().strip()
        if store.find_api_key(key) is not None:
            return key
    key = store.create_api_key("dev")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return key


class Up:
    """Brings the system up and down; one instance per ``llmgw up``."""

    def __init__(self, settings: UpSettings, say: Say) -> None:
        self.s = settings
        self.say = say
        self.work = settings.work_dir.resolve()
        self.children: list[Supervised] = []
        self.spec: ModelSpec | None = None
        self.client: Client | None = None
        # Set on shutdown: start-up work still running in a thread spawns
        # nothing more and stops waiting.
        self._closing = threading.Event()

    def prepare(self) -> ModelSpec:
        """Engine binary, tiny model, store, catalog entry."""
        self.work.mkdir(parents=True, exist_ok=True)
        ensure_llama_cpp(self.s.resolved_engine_cache_dir(), progress=self.say)
        self.say("generating the tiny test model")
        tiny = generate_tiny_model(self.work / "models" / "tiny")
        spec = ModelSpec(
            name=self.s.default_model, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path)
        )
        self.spec = spec
        store = Store(self.s.resolved_store_url())
        store.migrate()
        store.put_model(spec)
        store.close()
        return spec

    def _log_path(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def _spawn(self, name: str, argv: list[str], umask: int | None = None) -> Supervised:
        if self._closing.is_set():
            raise LlmgwError("stopping")
        env = child_env(self.s)
        log = self._log_path(name)
        child = Supervised(name, lambda: Child(name, argv, env, log, umask), self.say)
        self.children.append(child)
        return child

    def start_processes(self) -> None:
        """Temporal, control worker, agent, router; each checked before the next."""
        if port_open("127.0.0.1", self.s.temporal_port):
            raise LlmgwError(f"port {self.s.temporal_port} is taken: is another llmgw up running?")
        self.say("starting Temporal dev server")
        temporal = self._spawn(
            "temporal",
            [
                sys.executable,
                str(DEVSERVER),
                "--db",
                str(self.work / "temporal.db"),
                "--port",
                str(self.s.temporal_port),
                "--ui-port",
                str(self.s.ui_port),
            ],
            # Its database holds every workflow's history: the engine
            # group passes through the work dir and must not read it.
            umask=0o077,
        )
        if not wait_for(
            lambda: (
                port_open("127.0.0.1", self.s.temporal_port)
                or not temporal.alive()
                or self._closing.is_set()
            ),
            30,
        ):
            raise LlmgwError("Temporal did not start listening in 30s")
        if not temporal.alive():
            raise LlmgwError(f"Temporal exited:\n{log_tail(self._log_path('temporal'))}")
        for name in ("control", "agent"):
            self.say(f"starting {name}")
            self._spawn(name, [sys.executable, "-m", "llmgw_cli", name])
        self.say("starting router")
        router = self._spawn("router", [sys.executable, "-m", "llmgw_cli", "router"])
        if not wait_for(
            lambda: (
                port_open("127.0.0.1", self.s.router_port)
                or not router.alive()
                or self._closing.is_set()
            ),
            60,
        ):
            raise LlmgwError("router did not start listening in 60s")
        for child in self.children:
            if not child.alive():
                raise LlmgwError(f"{child.name} exited:\n{log_tail(self._log_path(child.name))}")

    async def supervise(self) -> None:
        """Restart, with backoff, any child that dies; runs until cancelled."""
        while True:
            for child in self.children:
                child.check()
            await asyncio.sleep(CHECK_INTERVAL_S)

    async def ensure_deployed(self, client: Client, spec: ModelSpec) -> str:
        """Deploy the default model (one replica, restarted if it fails) and
        wait until it serves; a deployment left by a killed run is reused."""

        def show(memo: ReplicaMemo) -> None:
            where = f" on {memo.node_id}" if memo.node_id else ""
            self.say(f"replica {memo.replica_id}: {memo.phase}{where}")

        await replicas.apply_deployment(client, spec, 1)
        self.say(f"deployment/{spec.name}: 1 replica desired")
        memo = await replicas.wait_deployment_ready(client, spec.name, self.s.ready_timeout_s, show)
        return memo.replica_id

    async def first_completion(self, key: str, model: str) -> str:
        """One real completion through the router: the proof it all works."""
        url = f"http://127.0.0.1:{self.s.router_port}/v1/completions"
        body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(100):
                resp = await http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
                if resp.status_code == 200:
                    return str(resp.json()["choices"][0]["text"])
                # 503 until the router's table refresh has seen the replica ready.
                await asyncio.sleep(0.2)
        raise LlmgwError(f"no completion through the router: {resp.status_code} {resp.text}")

    async def run(self, announce: Announce) -> None:
        """Bring everything up, announce it, then supervise until cancelled."""
        spec = await asyncio.to_thread(self.prepare)
        await asyncio.to_thread(self.start_processes)
        supervising = asyncio.create_task(self.supervise())
        try:
            self.client = client = await connect(f"127.0.0.1:{self.s.temporal_port}")
            self.say("waiting for the agent to register")
            await replicas.wait_node_registered(client, self.s.node_id, 120)
            await self.ensure_deployed(client, spec)
            store = Store(self.s.resolved_store_url())
            key = dev_api_key(store, self.work / "dev-api-key")
            store.close()
            text = await self.first_completion(key, spec.name)
            self.say(f"first completion: {text!r}")
            announce(
                f"http://127.0.0.1:{self.s.router_port}/v1",
                f"http://127.0.0.1:{self.s.ui_port}",
                key,
            )
            await supervising
        finally:
            supervising.cancel()

    async def _scale_to_zero(self, client: Client, timeout_s: float) -> None:
        """Drain the default deployment: its replicas stop, then it ends."""
        spec = self.spec
        if spec is None:
            return
        try:
            await replicas.remove_deployment(client, spec, timeout_s)
        except (RPCError, TimeoutError, WorkflowFailureError) as exc:
            self.say(f"deployment did not drain cleanly: {exc}")

    async def _stop_replicas(self, client: Client, timeout_s: float) -> None:
        await self._scale_to_zero(client, timeout_s)
        running = await replicas.list_replicas(client)
        await asyncio.gather(
            *(
                replicas.stop_replica(client, m.replica_id, "llmgw up stopping", timeout_s)
                for m in running
            ),
            return_exceptions=True,
        )

    async def _drain(self, budget_s: float) -> None:
        """Stop the replicas through Temporal within ``budget_s``, when it
        and the control worker are there to do it."""
        budget_s = min(self.s.stop_timeout_s, budget_s)
        serving = {c.name for c in self.children if c.alive()}
        client = self.client
        if client is None or not {"temporal", "control"} <= serving or budget_s <= 0:
            return
        if not await answers(client, TEMPORAL_CHECK_S):
            self.say("Temporal does not answer: engines are killed instead of drained")
            return
        try:
            async with asyncio.timeout(budget_s):
                await self._stop_replicas(client, budget_s)
        except TimeoutError:
            self.say(
                f"replicas not stopped through Temporal within {budget_s:g} s:"
                " their engines are killed instead"
            )
        except Exception as exc:
            self.say(f"could not stop replicas through Temporal: {exc}")

    async def shutdown(self) -> None:
        """Stop replicas through Temporal, then the processes, then stragglers,
        all within ``shutdown_timeout_s``."""
        self._closing.set()
        for child in self.children:
            # No restart from here on, not even of a child in backoff.
            child.hold()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.s.shutdown_timeout_s
        await self._drain(self.s.shutdown_timeout_s - PROCESS_STOP_RESERVE_S)
        for child in reversed(self.children):
            # Leaves about a second of the bound for the engines below.
            grace = max(0.0, deadline - 1.0 - loop.time())
            await asyncio.to_thread(child.stop, grace)
        for pgid in kill_recorded_engines(self.work / "agent"):
            self.say(f"killed leftover engine process group {pgid}")


async def answers(client: Client, timeout_s: float) -> bool:
    """Whether the Temporal server answers a health check within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await client.service_client.check_health(timeout=timedelta(seconds=timeout_s))
    except (RPCError, TimeoutError):
        return False


def kill_recorded_engines(agent_dir: Path) -> list[int]:
    """SIGKILL every engine group the agent's spec files still record."""
    killed: list[int] = []
    for spec_file in agent_dir.glob("*/shards/*/spec.json"):
        spec = SpecFile.load(spec_file)
        if spec is None:
            continue
        pid, pgid = spec.pid, spec.group
        started = spec.fingerprint.start_time if spec.fingerprint else None
        # The engine itself (a pid is reused only by a later start), or
        # what is left of its group once it died (the pass-through leads
        # the group); a group id is not reused while any member lives.
        ours = started is not None and procfs.start_time(pid) == started
        leftovers = not procfs.group_reused(pgid, spec.leader_start) and procfs.group_members(pgid)
        if ours or leftovers:
            try:
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        spec_file.unlink(missing_ok=True)
    return killed


@contextlib.contextmanager
def instance_lock(work: Path) -> Iterator[None]:
    """Hold ``work``'s ``up.lock`` while the block runs: one ``llmgw up`` per work dir.

    flock, not a pid file: the kernel drops the lock when its holder dies,
    however it dies, so a crashed run never blocks the next one, and a pid
    reused by another program is never taken for a live instance. The file
    names the holder's pid, for the message.

    Raises:
        InstanceRunningError: another live process holds the lock.
    """
    work.mkdir(parents=True, exist_ok=True)
    path = work / "up.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise InstanceRunningError(
                f"another llmgw up is running in {work} (pid {holder}): not starting;"
                " its processes and engines are left alone. Stop it first (Ctrl-C"
                " where it runs), or use another LLMGW_WORK_DIR."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


async def run_up(settings: UpSettings, say: Say, announce: Announce) -> None:
    """Bring everything up, announce it, and supervise until SIGINT/SIGTERM
    (which also interrupts a start-up still under way).

    Raises:
        InstanceRunningError: another ``llmgw up`` runs in the work dir.
    """
    with instance_lock(settings.work_dir.resolve()):
        up = Up(settings, say)
        # The watchdog is a last resort behind shutdown's own deadline.
        stop = stop_event_on_signals(settings.shutdown_timeout_s + 0.9)
        try:
            await unless_stopped(stop, up.run(announce))
        finally:
            say("stopping")
            await up.shutdown()
