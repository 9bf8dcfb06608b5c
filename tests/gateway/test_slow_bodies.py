"""Slow request bodies against the real router process (llmgw/listener.py).

A thousand authenticated requests trickle their bodies, from ten client
addresses (127.0.0.2-11, each at the per-client cap), and each address
tries twenty connections more, which are refused at accept. A normal client
(127.0.0.1) is then served within a second; without the per-client cap the
extra connections would have filled the router's connection cap and the
normal client been refused. Past the body timeout every trickling request
gets 408 in the OpenAI error format and its connection is closed.

Plain blocking sockets, as tests/gateway/test_listener_limits.py: the client
does nothing while the server works, so the timing is the server's.
"""

import contextlib
import json
import resource
import socket
import time

import pytest

from llmgw_cli.procs import wait_for
from tests.gateway.test_listener_limits import closed_by_server, response
from tests.harness import System, free_port

ADDRESSES = [f"127.0.0.{i}" for i in range(2, 12)]
PER_CLIENT = 100  # the cap: ten addresses hold 1,000 trickling bodies
EXTRA = 20  # per address, past the cap
TRICKLING = len(ADDRESSES) * PER_CLIENT
# Room for the trickling ones and the normal client, not for the extra ones too.
MAX_CONNECTIONS = TRICKLING + 100
SERVED_WITHIN_S = 1.0
BODY_TIMEOUT_S = 8.0
# Generous: two shared cores; the bound checked is that the server answers them.
MARGIN_S = 15.0


@pytest.fixture(scope="module", autouse=True)
def _open_files() -> None:
    """Room for every client socket in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = TRICKLING + len(ADDRESSES) * EXTRA + 256
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.fail(f"open-file hard limit {hard} < {needed}: raise it (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _head(key: str, length: int) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def _read(s: socket.socket, got: dict[socket.socket, bytes]) -> bool:
    """Add what the server sent on ``s`` to ``got[s]``; whether it has closed it."""
    s.setblocking(False)
    try:
        while chunk := s.recv(65536):
            got[s] = got.get(s, b"") + chunk
    except BlockingIOError:
        return False
    except ConnectionError:
        pass
    return True


@pytest.fixture
def router(system: System) -> tuple[int, str]:
    key = system.catalog()
    port = free_port()
    system.env.update(
        {
            "LLMGW_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
            "LLMGW_HEADER_TIMEOUT_S": "60",
            "LLMGW_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "LLMGW_MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT),
            # A router just started on shared cores: its first key lookup
            # must not be given up on (503) while the tricklers arrive.
            "LLMGW_STORE_WAIT_S": "30",
        }
    )
    system.start_router(port)
    with _connect(port, "127.0.0.1") as warm:  # the key is cached from here on
        warm.sendall(f"GET /v1/models HTTP/1.1\r\nHost: t\r\n{_auth(key)}\r\n".encode())
        assert response(warm).startswith(b"HTTP/1.1 200")
    return port, key


def _auth(key: str) -> str:
    return f"Authorization: Bearer {key}\r\n"


def test_trickling_bodies_neither_starve_a_client_nor_stay(router: tuple[int, str]) -> None:
    port, key = router
    trickling: list[socket.socket] = []
    extra: list[socket.socket] = []
    try:
        opened = time.monotonic()
        for address in ADDRESSES:
            for _ in range(PER_CLIENT):
                s = _connect(port, address)
                s.sendall(_head(key, 1000) + b'{"model": ')
                trickling.append(s)
            for _ in range(EXTRA):
                with contextlib.suppress(ConnectionError):
                    extra.append(_connect(port, address))
        # Past the per-client cap: refused at accept.
        assert wait_for(lambda: all(closed_by_server(s) for s in extra), MARGIN_S, interval_s=0.1)
        for s in trickling:
            s.sendall(b"[")  # the bodies trickle on

        # A body the router reads whole and refuses on its own (no model: 400),
        # never waiting on anything else (an unknown model waits for a catalog
        # re-read, up to seconds on busy cores; a known one for a replica).
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        with _connect(port, "127.0.0.1") as normal:
            start = time.monotonic()
            normal.sendall(_head(key, len(body)) + body.encode())
            answer = response(normal)
            normal.sendall(f"GET /v1/models HTTP/1.1\r\nHost: t\r\n{_auth(key)}\r\n".encode())
            models = response(normal)
            served_s = time.monotonic() - start
        # The whole request was read and answered: the missing field's 400, then a 200.
        assert answer.startswith(b"HTTP/1.1 400") and b'"param":"model"' in answer.replace(
            b" ", b""
        ), answer[:300]
        assert models.startswith(b"HTTP/1.1 200"), models[:300]
        assert served_s < SERVED_WITHIN_S, f"served in {served_s:.2f}s beside {TRICKLING} bodies"
        got: dict[socket.socket, bytes] = {}
        closed = {s for s in trickling if _read(s, got)}
        assert not closed and not got, (
            f"{len(closed)} trickling requests closed, {len(got)} answered, before the body"
            f" timeout: {next(iter(got.values()), b'')[:200]!r}"
        )

        deadline = opened + BODY_TIMEOUT_S + MARGIN_S
        while len(closed) < len(trickling) and time.monotonic() < deadline:
            closed |= {s for s in trickling if s not in closed and _read(s, got)}
            time.sleep(0.2)
        assert len(closed) == len(trickling), (
            f"{len(trickling) - len(closed)} trickling requests still open"
            f" {deadline - opened:.0f}s after opening"
        )
        assert time.monotonic() - opened >= BODY_TIMEOUT_S
        for s in trickling:
            head, _, rest = got.get(s, b"").partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), got.get(s, b"")[:200]
            error = json.loads(rest)["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "body_timeout")
    finally:
        for s in [*trickling, *extra]:
            s.close()
