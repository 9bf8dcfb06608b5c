"""``llmgw up`` (what ``make run`` runs): serves a completion, and Ctrl-C
leaves no process behind, engines included; a child that dies is started
again (an agent SIGKILLed mid-traffic adopts its engine, no request fails);
SIGTERM ends it in time even with Temporal frozen."""

import asyncio
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client

from llmgw import contracts, replicas
from llmgw.queues import replica_workflow_id
from llmgw.temporal import connect
from llmgw.types import ReplicaPhase, ReplicaStatus
from llmgw_cli.procs import wait_for
from llmgw_cli.up import instance_lock
from tests.conftest import LlamaPath
from tests.harness import engine_cache, free_port
from tests.procs_util import engine_pids, pids_with_args, pids_with_env

# SIGTERM to exit, for every llmgw process (README, "llmgw up").
SHUTDOWN_BOUND_S = 10.0


class Console:
    """Everything ``llmgw up`` prints, read as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._proc = proc
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._lock:
                self.lines.append(line)

    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)

    def wait_for(self, marker: str, timeout_s: float) -> bool:
        """Whether a line with ``marker`` appears within ``timeout_s``."""
        return wait_for(lambda: marker in self.text() or self._proc.poll() is not None, timeout_s)

    def close(self) -> None:
        self._reader.join(timeout=10)  # it ends at EOF, once the process is gone


@dataclass
class Up:
    proc: subprocess.Popen[str]
    console: Console
    work: Path
    router_port: int
    temporal_port: int
    key: str = field(default="")

    def router(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.router_port}/v1", api_key=self.key, max_retries=0
        )


def start_up(
    work: Path, router_port: int, temporal_port: int, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``llmgw up`` in ``work``, as a user starts it, its console piped."""
    env = dict(
        os.environ,
        LLMGW_WORK_DIR=str(work),
        LLMGW_ENGINE_CACHE_DIR=str(engine_cache()),
        LLMGW_PORT_RANGE_START=str(free_port()),
        # pytest's temp dirs are 0700: an engine user could not reach them
        # (as in tests/harness.py).
        LLMGW_ALLOW_ROOT_ENGINES="true",
        **(extra_env or {}),
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw_cli",
            "up",
            "--router-port",
            str(router_port),
            "--temporal-port",
            str(temporal_port),
            "--ui-port",
            str(free_port()),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # what it says goes to stderr
        text=True,
        start_new_session=True,
    )


@contextmanager
def running_up(tmp_path: Path, extra_env: dict[str, str] | None = None) -> Iterator[Up]:
    """``llmgw up`` serving, as a user starts it; killed at the end if still running."""
    work = tmp_path / "work"
    router_port, temporal_port = free_port(), free_port()
    proc = start_up(work, router_port, temporal_port, extra_env)
    console = Console(proc)
    try:
        up = Up(proc, console, work, router_port, temporal_port)
        assert console.wait_for("Ctrl-C stops everything", 240), console.text()[-3000:]
        up.key = (work / "dev-api-key").read_text().strip()
        assert up.key in console.text(), console.text()[-3000:]
        yield up
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        console.close()
        if proc.stdout is not None:
            proc.stdout.close()


def stopped_within(up: Up, sig: signal.Signals, bound_s: float) -> float | None:
    """Send ``sig`` to ``llmgw up``; seconds until it exited, None if not within ``bound_s``."""
    sent = time.monotonic()
    up.proc.send_signal(sig)
    try:
        up.proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - sent


def assert_nothing_left(work: Path) -> None:
    assert pids_with_env(f"LLMGW_WORK_DIR={work}") == []
    assert pids_with_args(str(work)) == []
    assert engine_pids(work) == []


def test_up_serves_a_completion_and_ctrl_c_cleans_up(tmp_path: Path) -> None:
    with running_up(tmp_path) as up:
        assert f"http://127.0.0.1:{up.router_port}/v1" in up.console.text()
        resp = up.router().completions.create(
            model="tiny", prompt="Hello", max_tokens=4, temperature=0
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 4
        assert len(engine_pids(up.work, "--alias", "tiny")) == 1
        # What the processes print, and Temporal's histories, are not the
        # engine group's to read: it may pass through the (0710) work dir.
        logs = up.work / "logs"
        assert stat.S_IMODE(logs.stat().st_mode) == 0o700
        for path in [*logs.iterdir(), up.work / "temporal.db"]:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

        took = stopped_within(up, signal.SIGINT, SHUTDOWN_BOUND_S)
        assert took is not None, up.console.text()[-3000:]
        assert up.proc.returncode == 0
    assert_nothing_left(up.work)


def test_a_second_up_in_the_same_work_dir_leaves_the_first_alone(tmp_path: Path) -> None:
    """A second ``make run`` while one serves: it used to fail on the taken
    Temporal port and then, stopping, kill the first one's engines."""
    with running_up(tmp_path) as up:
        engines = engine_pids(up.work, "--alias", "tiny")
        assert len(engines) == 1
        # The same command again: same work dir, same ports.
        second = start_up(up.work, up.router_port, up.temporal_port)
        out, _ = second.communicate(timeout=120)
        assert second.returncode != 0, out
        assert f"another llmgw up is running in {up.work.resolve()}" in out, out
        assert f"(pid {up.proc.pid})" in out, out
        assert "killed leftover engine" not in out, out
        assert engine_pids(up.work, "--alias", "tiny") == engines
        resp = up.router().completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert resp.usage is not None and resp.usage.completion_tokens == 2

        took = stopped_within(up, signal.SIGINT, SHUTDOWN_BOUND_S)
        assert took is not None, up.console.text()[-3000:]
    assert_nothing_left(up.work)
    # The lock went with its holder: the next up may start.
    with instance_lock(up.work):
        pass


class Load:
    """Completions sent one after another through the router, counted."""

    def __init__(self, client: openai.OpenAI) -> None:
        self._client = client
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._client.with_options(timeout=30).completions.create(
                    model="tiny", prompt="Hello", max_tokens=2, temperature=0
                )
                self.ok += 1
            except openai.OpenAIError as exc:
                self.failures.append(f"{time.monotonic():.1f}: {exc!r}"[:300])

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def agent_pid(work: Path) -> int | None:
    """The pid of the node agent that ``llmgw up`` in ``work`` runs."""
    ours = set(pids_with_env(f"LLMGW_WORK_DIR={work}"))
    found = [p for p in pids_with_args("-m", "llmgw_cli", "agent") if p in ours]
    return found[0] if len(found) == 1 else None


async def watched_by(client: Client, replica_id: str, pid: int) -> bool:
    """Whether the replica's engine watch runs on the agent process ``pid``
    (the SDK's worker identity starts with its pid)."""
    desc = await client.get_workflow_handle(replica_workflow_id(replica_id)).describe()
    return any(
        a.activity_type.name == contracts.WATCH_SHARD.name
        and a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        and a.last_worker_identity.startswith(f"{pid}@")
        for a in desc.raw_description.pending_activities
    )


def test_an_agent_killed_under_up_is_restarted_and_adopts_its_engine_with_no_failed_request(
    tmp_path: Path, llama_path: LlamaPath
) -> None:
    """On each llama.cpp install path (issue 23: with the portable one, 20 of 40
    requests failed and a new engine replaced the adopted one)."""
    with running_up(tmp_path, llama_path.agent_env()) as up:
        engines = engine_pids(up.work, "--alias", "tiny")
        assert len(engines) == 1
        assert llama_path.runs(engines[0]), llama_path
        old_agent = agent_pid(up.work)
        assert old_agent is not None
        replica_memo = asyncio.run(_only_replica(up.temporal_port))
        with Load(up.router()) as load:
            assert wait_for(lambda: load.ok >= 5, 60), load.failures
            killed_at = time.monotonic()
            os.kill(old_agent, signal.SIGKILL)
            assert up.console.wait_for("agent exited with code -9; restarting in 1 s", 30)
            assert up.console.wait_for("agent restarted", 30), up.console.text()[-2000:]
            restarted_s = time.monotonic() - killed_at
            new_agent = agent_pid(up.work)
            assert new_agent is not None and new_agent != old_agent
            agent_log = up.work / "logs" / "agent.log"
            assert wait_for(lambda: "adopted 1 engines" in agent_log.read_text(), 60)
            adopted_locally_s = time.monotonic() - killed_at
            adopted_s = asyncio.run(
                _wait_watched(up.temporal_port, replica_memo, new_agent, killed_at, 180)
            )
            assert adopted_s is not None, (up.work / "logs" / "agent.log").read_text()[-3000:]
            # Traffic on through the adopted engine for a while longer.
            served = load.ok
            assert wait_for(lambda: load.ok >= served + 10, 60)
        assert load.failures == [], load.failures[:5]
        assert engine_pids(up.work, "--alias", "tiny") == engines  # the same engine
        status = asyncio.run(_status(up.temporal_port, replica_memo))
        assert status.phase == ReplicaPhase.READY and status.pid == engines[0]
        print(
            f"\nagent SIGKILLed: restarted after {restarted_s:.1f} s, engine adopted by it"
            f" after {adopted_locally_s:.1f} s, watched by it with the replica ready after"
            f" {adopted_s:.1f} s; {load.ok} requests, 0 failed; replica history:"
            f" {[(h.phase.value, h.at) for h in status.history]}"
        )

        took = stopped_within(up, signal.SIGTERM, SHUTDOWN_BOUND_S)
        assert took is not None, up.console.text()[-3000:]
    assert_nothing_left(up.work)


def test_up_stops_in_time_while_temporal_is_frozen(tmp_path: Path) -> None:
    with running_up(tmp_path) as up:
        servers = pids_with_args("server", "start-dev", str(up.work))
        assert len(servers) == 1
        os.kill(servers[0], signal.SIGSTOP)
        try:
            took = stopped_within(up, signal.SIGTERM, SHUTDOWN_BOUND_S)
        finally:
            # Killed by up (SIGKILL reaches a stopped process); in case not.
            for pid in pids_with_args("server", "start-dev", str(up.work)):
                os.kill(pid, signal.SIGCONT)
        assert took is not None, up.console.text()[-3000:]
        assert "Temporal does not answer" in up.console.text()
    assert_nothing_left(up.work)


async def _only_replica(temporal_port: int) -> str:
    client = await connect(f"127.0.0.1:{temporal_port}")
    running = await replicas.list_replicas(client)
    assert len(running) == 1
    return running[0].replica_id


async def _status(temporal_port: int, replica_id: str) -> ReplicaStatus:
    client = await connect(f"127.0.0.1:{temporal_port}")
    status = await replicas.status_of(client, replica_id)
    assert status is not None
    return status


async def _wait_watched(
    temporal_port: int, replica_id: str, agent: int, since: float, timeout_s: float
) -> float | None:
    """Seconds from ``since`` until the replica is ready and its engine
    watched by ``agent``; None if not within ``timeout_s``."""
    client = await connect(f"127.0.0.1:{temporal_port}")
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        status = await replicas.status_of(client, replica_id)
        if (
            status is not None
            and status.phase == ReplicaPhase.READY
            and await watched_by(client, replica_id, agent)
        ):
            return time.monotonic() - since
        await asyncio.sleep(0.2)
    return None
