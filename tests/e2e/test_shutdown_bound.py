"""SIGTERM ends every llmgw process within 10 s even when what it talks to
does not answer: a Temporal server frozen (SIGSTOP) or killed, a PostgreSQL
store frozen or stopped. Real processes, real servers, each test with its own
server so freezing it disturbs no other test."""

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.lifecycle import WATCHDOG_EXIT
from llmgw_cli.procs import Child, wait_for
from tests.harness import System, free_port, start_devserver
from tests.pg import PgCluster, own_cluster

BOUND_S = 10.0


def exit_times(children: list[Child], bound_s: float) -> dict[str, float]:
    """SIGTERM every child at once; how long each took to exit (those that did)."""
    sent = time.monotonic()
    for child in children:
        child.signal(signal.SIGTERM)
    took: dict[str, float] = {}
    while len(took) < len(children) and time.monotonic() - sent < bound_s:
        for child in children:
            if child.name not in took and not child.alive():
                took[child.name] = time.monotonic() - sent
        time.sleep(0.05)
    return took


def report(children: list[Child], took: dict[str, float]) -> str:
    lines = [f"exited: { {k: round(v, 1) for k, v in took.items()} }"]
    for child in children:
        lines.append(f"--- {child.name} (exit {child.exit_code()}):\n{child.log_tail(15)}")
    return "\n".join(lines)


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_sigterm_ends_every_process_in_time_while_temporal_is_down(
    tmp_path: Path, fault: str
) -> None:
    port = free_port()
    server = start_devserver(tmp_path / "temporal.db", port, tmp_path / "temporal.log")
    system = System(f"127.0.0.1:{port}", tmp_path / "llmgw", free_port())
    system.work_dir.mkdir()
    try:
        system.catalog()
        control = system.spawn("control")
        agent = system.spawn_agent("bound-node")
        router = system.start_router(free_port())
        children = [control, agent, router]
        assert wait_for(
            lambda: "serving node-bound-node" in agent.log_path.read_text() or not agent.alive(),
            120,
        ), agent.log_tail()
        assert wait_for(lambda: "control worker on" in control.log_path.read_text(), 60)
        if fault == "frozen":
            server.signal(signal.SIGSTOP)
        else:
            server.stop()
        took = exit_times(children, BOUND_S)
        assert set(took) == {c.name for c in children}, report(children, took)
        # Within the bound by their own timeouts, not by the watchdog's cut.
        assert all(c.exit_code() != WATCHDOG_EXIT for c in children), report(children, took)
    finally:
        server.signal(signal.SIGCONT)
        system.stop()
        server.stop()


def read_by_server(server_port: int, client_port: int) -> bool:
    """Whether the server side of this loopback connection has read all that
    was sent to it (its receive queue in /proc/net/tcp is empty)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if (
            int(local.split(":")[1], 16) == server_port
            and int(remote.split(":")[1], 16) == client_port
        ):
            return int(queues.split(":")[1], 16) == 0
    return False


@pytest.fixture
def own_pg() -> Iterator[PgCluster]:
    """A PostgreSQL server of this test's own, to freeze or stop."""
    with own_cluster() as cluster:
        yield cluster


@pytest.mark.parametrize("fault", ["frozen", "stopped"])
def test_sigterm_ends_router_and_control_in_time_while_the_store_is_down(
    temporal_address: str, tmp_path: Path, own_pg: PgCluster, fault: str
) -> None:
    system = System(temporal_address, tmp_path / "llmgw", free_port())
    system.work_dir.mkdir()
    system.store_url = own_pg.create_database()
    system.env["LLMGW_STORE_URL"] = system.store_url
    frozen: list[int] = []
    opened: list[socket.socket] = []
    try:
        key = system.catalog()
        control = system.spawn(
            "control",
            {"LLMGW_RECONCILE_CATALOG": "true", "LLMGW_RECONCILE_INTERVAL_S": "0.5"},
        )
        router_port = free_port()
        router = system.start_router(router_port)
        children = [control, router]
        assert wait_for(lambda: "control worker on" in control.log_path.read_text(), 60)
        if fault == "frozen":
            frozen = own_pg.pids()
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
        else:
            own_pg.stop()

        # A request in flight that waits on the store (its key is not cached
        # yet): the router's shutdown must not wait for it forever.
        request = socket.create_connection(("127.0.0.1", router_port), timeout=30)
        opened.append(request)
        request.sendall(
            f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        )
        assert wait_for(lambda: read_by_server(router_port, request.getsockname()[1]), 10)
        took = exit_times(children, BOUND_S)
        assert set(took) == {c.name for c in children}, report(children, took)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        system.stop()
        for sock in opened:
            sock.close()
