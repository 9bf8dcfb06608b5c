"""A 502 tells the client which model failed, never an address or a path of
ours; the log line keeps the detail and the replica. Real sockets on
loopback: the router's default engine client (RawUpstream) and the engine
pass-through."""

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import httpx
import pytest

from llmgw.store import Store
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from router.forwarding.upstream_raw import RawUpstream
from tests.gateway_util import FakeSource, auth, ready, serving, spec
from worker_agent.passthrough import PassThrough

M = "m1"


@asynccontextmanager
async def closed_port() -> AsyncIterator[int]:
    """A port bound but never listening: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@asynccontextmanager
async def hanging_up() -> AsyncIterator[int]:
    """An engine that accepts each connection and resets it unanswered."""

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.close()

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


def assert_private(body: str, port: int) -> None:
    assert "127.0.0.1" not in body and str(port) not in body, body
    message = json.loads(body)["error"]["message"]
    assert "/" not in message, message  # no path (nor URL) of the node


@pytest.mark.parametrize("engine", [closed_port, hanging_up])
async def test_a_router_502_names_the_model_not_the_engine(
    tmp_path: Path,
    engine: Callable[[], AbstractAsyncContextManager[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    store.put_model(spec(M))
    _, key = create_key(store, "k", KeyPolicy())
    async with engine() as port:
        replicas = [ready("r-secret-1", M, f"http://127.0.0.1:{port}")]
        app = create_app(
            store,
            FakeSource(replicas),
            refresh_interval_s=0.05,
            http=RawUpstream(connect_timeout_s=5, read_timeout_s=10, max_connections=4),
        )
        async with serving(app) as http:
            with caplog.at_level(logging.WARNING, logger="router.forwarding.proxy"):
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": M, "messages": [{"role": "user", "content": "hi"}]},
                    headers=auth(key),
                )
    store.close()
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    assert f"`{M}`" in r.json()["error"]["message"]
    assert_private(r.text, port)
    # The operator's side has the replica and what went wrong.
    logged = [rec.getMessage() for rec in caplog.records if "r-secret-1" in rec.getMessage()]
    assert any("Error" in line for line in logged), logged


async def test_a_pass_through_502_names_no_address() -> None:
    async with closed_port() as port:
        app = PassThrough(f"http://127.0.0.1:{port}", "engine-key")
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
                r = await http.post(
                    "/v1/completions",
                    content=b"{}",
                    headers={"Authorization": "Bearer engine-key"},
                )
        finally:
            await app.aclose()
    assert r.status_code == 502
    assert_private(r.text, port)
