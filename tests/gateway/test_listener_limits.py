"""Slow and idle clients against the real listeners: the router process and the
engine pass-through process (llmgw/listener.py).

A thousand half-open connections (nothing sent, half a request line, or
headers without their end) are held while a normal request is timed; then
the server, not the client, must close every one of them once the header
timeout passes, including those trickling a byte at a time. Plain blocking
sockets: the client does nothing while the server works, so the timing is the
server's.
"""

import contextlib
import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llmgw_cli.procs import Child, wait_for
from tests.harness import System, free_port, port_open
from worker_agent import passthrough

HALF_OPEN = 1000
TRICKLERS = 5
SERVED_WITHIN_S = 2.0
HEADER_TIMEOUT_S = 6.0
# Generous: two shared cores; the bound checked is that the server closes them.
CLOSE_MARGIN_S = 10.0
KEY = "llmgw-engine-listener-test"

# What a slowloris leaves behind: nothing, a partial request line, headers without their end.
_PARTIALS = (b"", b"GET /healthz HT", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")


@pytest.fixture(scope="module", autouse=True)
def _open_files() -> None:
    """Room for a thousand client sockets in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = HALF_OPEN + TRICKLERS + 256
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.fail(f"open-file hard limit {hard} < {needed}: raise it (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def hold(port: int, n: int) -> list[socket.socket]:
    """``n`` connections, each left at one of ``_PARTIALS``."""
    socks = []
    for i in range(n):
        s = _connect(port)
        if data := _PARTIALS[i % len(_PARTIALS)]:
            s.sendall(data)
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed (EOF) or reset the connection; never blocks."""
    s.setblocking(False)  # with a timeout set, even MSG_DONTWAIT waits it out
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def request(s: socket.socket, path: str, headers: dict[str, str] | None = None) -> bytes:
    """One keep-alive GET on ``s``; returns the response (head and Content-Length body)."""
    lines = [
        f"GET {path} HTTP/1.1",
        "Host: test",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return response(s)


def response(s: socket.socket) -> bytes:
    """One response (head and Content-Length body) read off ``s``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before the response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed in the middle of the body"
        body += chunk
    return head + b"\r\n\r\n" + body


def served(port: int) -> bool:
    """Whether one authorized request gets its 200 (False if the connection is refused)."""
    try:
        with _connect(port) as s:
            return request(s, "/health", {"Authorization": f"Bearer {KEY}"}).startswith(
                b"HTTP/1.1 200"
            )
    except (ConnectionError, AssertionError):
        return False


def check_slowloris(port: int, path: str, headers: dict[str, str] | None = None) -> None:
    """The acceptance: served within 2 s under 1,000 half-open connections, which
    (and trickling ones) the server then closes after the header timeout."""
    opened = time.monotonic()
    held = hold(port, HALF_OPEN)
    tricklers = [_connect(port) for _ in range(TRICKLERS)]
    for s in tricklers:
        s.sendall(b"GET / HTTP/1.1\r\n")
    try:
        with _connect(port) as normal:
            start = time.monotonic()
            response = request(normal, path, headers)
            served_s = time.monotonic() - start
        assert response.startswith(b"HTTP/1.1 200"), response[:200]
        assert served_s < SERVED_WITHIN_S, f"served in {served_s:.2f}s under {HALF_OPEN} half-open"
        # Still held: the request was served alongside them, not after they went.
        early = sum(closed_by_server(s) for s in held)
        assert early == 0, f"{early} half-open connections closed before the header timeout"

        deadline = opened + HEADER_TIMEOUT_S + CLOSE_MARGIN_S
        open_ = [*held, *tricklers]
        while open_ and time.monotonic() < deadline:
            for s in tricklers:
                with contextlib.suppress(OSError):
                    s.send(b"X")  # a header name, one byte at a time
            open_ = [s for s in open_ if not closed_by_server(s)]
            time.sleep(0.5)
        left = len(open_)
        assert left == 0, f"{left} connections still open {deadline - opened:.0f}s after opening"
        # Closed by the timeout, not before it.
        assert time.monotonic() - opened >= HEADER_TIMEOUT_S
    finally:
        for s in [*held, *tricklers]:
            s.close()


# --- the router -------------------------------------------------------------


@pytest.fixture
def router(system: System) -> int:
    port = free_port()
    system.env.update(
        {
            "LLMGW_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "LLMGW_KEEPALIVE_TIMEOUT_S": "1",
            "LLMGW_MAX_CONNECTIONS": str(HALF_OPEN + 100),
        }
    )
    system.start_router(port)
    return port


def test_router_serves_under_slowloris(router: int) -> None:
    check_slowloris(router, "/healthz")


def test_router_closes_idle_kept_alive_connection(router: int) -> None:
    with _connect(router) as s:
        assert request(s, "/healthz").startswith(b"HTTP/1.1 200")
        assert request(s, "/healthz").startswith(b"HTTP/1.1 200")  # kept alive
        answered = time.monotonic()
        assert wait_for(lambda: closed_by_server(s), 1 + CLOSE_MARGIN_S, interval_s=0.05)
        assert time.monotonic() - answered >= 0.9


# --- the pass-through -------------------------------------------------------


class _Engine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # One write per answer, sent at once (else Nagle and delayed ACKs add 40 ms).
    wbufsize = 65536
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def engine_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def start_passthrough(upstream_port: int, log: Path, *flags: str) -> tuple[Child, int]:
    port = free_port()
    argv = passthrough.command(
        sys.executable, "127.0.0.1", port, f"http://127.0.0.1:{upstream_port}"
    )
    env = {**os.environ, passthrough.KEY_ENV: KEY}
    child = Child("passthrough", [*argv, *flags], env, log)
    if not wait_for(lambda: port_open(port) or not child.alive(), 30):
        child.stop()
        raise RuntimeError(f"pass-through did not start:\n{child.log_tail()}")
    assert child.alive(), child.log_tail()
    return child, port


def test_passthrough_serves_under_slowloris(engine_port: int, tmp_path: Path) -> None:
    child, port = start_passthrough(
        engine_port, tmp_path / "pt.log", "--header-timeout", str(HEADER_TIMEOUT_S)
    )
    try:
        check_slowloris(port, "/health", {"Authorization": f"Bearer {KEY}"})
    finally:
        child.stop(grace_s=5)


def test_passthrough_caps_connections_and_head_size(engine_port: int, tmp_path: Path) -> None:
    cap = 20
    child, port = start_passthrough(engine_port, tmp_path / "pt.log", "--max-connections", str(cap))
    held: list[socket.socket] = []
    try:
        with _connect(port) as s:  # a head past the bound: 431, and closed
            s.sendall(b"GET /health HTTP/1.1\r\n" + b"X-Big: " + b"a" * 200_000 + b"\r\n")
            answer = s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
            assert wait_for(lambda: closed_by_server(s), CLOSE_MARGIN_S, interval_s=0.05)
        held = hold(port, cap + 10)
        # The ten past the cap are refused at once; the rest wait on the header timeout.
        assert wait_for(
            lambda: sum(closed_by_server(s) for s in held) >= 10, CLOSE_MARGIN_S, interval_s=0.1
        )
        refused = [i for i, s in enumerate(held) if closed_by_server(s)]
        assert len(refused) == 10, refused
        assert "connections open: refusing more" in child.log_tail(50)
        # A slot freed is a slot served (once the server has seen the close).
        held[0].close()
        assert wait_for(lambda: served(port), CLOSE_MARGIN_S, interval_s=0.2)
    finally:
        for s in held:
            s.close()
        child.stop(grace_s=5)
