"""The pass-through between real loopback sockets: a raw HTTP/1.1 client, the
pass-through served by uvicorn, and a few lines of asyncio as the engine, so a
test can say exactly which bytes reach the engine and when a connection closes.
Every test also fails if uvicorn or asyncio logged an error (a relay that raised)."""

import asyncio
import contextlib
import gzip
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn

from llmgw.errors import EngineLaunchError
from tests.harness import reset as rst
from worker_agent.passthrough import KEY_ENV, PassThrough, keys_input

KEY = "llmgw-engine-test"
AUTH = f"Bearer {KEY}".encode()
Header = tuple[bytes, bytes]


@dataclass
class Request:
    line: bytes
    headers: list[Header]
    body: bytes


@dataclass
class Engine:
    """What a scripted engine saw."""

    port: int = 0
    connections: int = 0
    requests: list[Request] = field(default_factory=list)


Handler = Callable[[Engine, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One request (head and Content-Length body); None when the peer closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    line, *lines = head[:-4].split(b"\r\n")
    headers = [_split(h) for h in lines]
    length = int(_get(headers, b"content-length") or 0)
    return Request(line, headers, await reader.readexactly(length))


def response(status: int, headers: list[Header], body: bytes) -> bytes:
    head = [b"HTTP/1.1 %d X" % status] + [k + b": " + v for k, v in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _split(line: bytes) -> Header:
    name, _, value = line.partition(b":")
    return name.lower(), value.strip()


def _get(headers: list[Header], name: bytes) -> bytes | None:
    return next((v for k, v in headers if k == name), None)


@asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[Engine]:
    seen = Engine()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        try:
            await handler(seen, reader, writer)
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    seen.port = srv.sockets[0].getsockname()[1]
    try:
        yield seen
    finally:
        srv.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(srv.wait_closed(), 5)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@asynccontextmanager
async def front(
    upstream_port: int, engine_key: str = "", close_engine_connections: bool = False
) -> AsyncIterator[int]:
    """The pass-through served by uvicorn on loopback, in this loop; yields its port.
    ``close_engine_connections``: llama.cpp's mode, a connection per request."""
    app = PassThrough(
        f"http://127.0.0.1:{upstream_port}",
        KEY,
        connect_timeout_s=5,
        engine_key=engine_key,
        close_engine_connections=close_engine_connections,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections queue until uvicorn accepts: no waiting for it to start
    config = uvicorn.Config(
        app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    errors = _Errors()
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("asyncio")]
    for logger in loggers:
        logger.addHandler(errors)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        await app.aclose()
        sock.close()
        for logger in loggers:
            logger.removeHandler(errors)
    assert [r.getMessage() for r in errors.records] == []


class Client:
    """One raw HTTP/1.1 connection to the pass-through."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> "Client":
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, method: bytes, target: bytes, headers: list[Header], body: bytes = b"") -> None:
        head = [method + b" " + target + b" HTTP/1.1"] + [k + b": " + v for k, v in headers]
        self.writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)

    async def head(self) -> tuple[int, list[Header]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        line, *lines = raw[:-4].split(b"\r\n")
        return int(line.split()[1]), [_split(h) for h in lines]

    async def chunk(self) -> bytes:
        """One chunk of a chunked body as it is on the wire (b"" for the last)."""
        size = int(await self.reader.readuntil(b"\r\n"), 16)
        return (await self.reader.readexactly(size + 2))[:-2]

    async def body(self, headers: list[Header]) -> bytes:
        length = _get(headers, b"content-length")
        if length is not None:
            return await self.reader.readexactly(int(length))
        parts = []
        while part := await self.chunk():
            parts.append(part)
        return b"".join(parts)

    async def exchange(
        self, method: bytes, target: bytes, headers: list[Header], body: bytes = b""
    ) -> tuple[int, list[Header], bytes]:
        if body and _get(headers, b"content-length") is None:
            headers = [*headers, (b"content-length", b"%d" % len(body))]
        self.send(method, target, [(b"host", b"node:1"), *headers], body)
        status, got = await self.head()
        return status, got, await self.body(got)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


async def serve_all(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Keeps every request and answers each 200, echoing its body (kept alive)."""
    while (request := await read_request(reader)) is not None:
        seen.requests.append(request)
        w.write(response(200, [(b"content-length", b"%d" % len(request.body))], request.body))
        await w.drain()


@pytest.mark.parametrize("path", [b"/v1/completions", b"/invocations", b"/adapters", b"/metrics"])
@pytest.mark.parametrize("auth", [None, b"Bearer wrong", AUTH + b"x", b"", KEY.encode()])
async def test_every_path_needs_the_key(path: bytes, auth: bytes | None) -> None:
    async with engine(serve_all) as seen, front(seen.port) as port:
        client = await Client.open(port)
        headers = [] if auth is None else [(b"authorization", auth)]
        status, _, body = await client.exchange(b"POST", path, headers, b"{}")
        await client.close()
    assert status == 401
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert seen.connections == 0  # nothing reached the engine


@pytest.mark.parametrize("closes", [False, True])
async def test_with_the_key_the_request_and_answer_pass_unchanged(closes: bool) -> None:
    async def answer(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            headers = [(b"x-engine", b"yes"), (b"content-length", b"%d" % len(request.body))]
            w.write(response(201, headers, request.body))

    client_headers = [
        (b"authorization", AUTH),  # without an engine key of its own, the engine gets it
        (b"user-agent", b"client/1"),
        (b"accept", b"text/event-stream"),
        (b"accept-encoding", b"gzip"),
        (b"content-type", b"application/json"),
        (b"x-dup", b"1"),
        (b"x-dup", b"2"),
        (b"x-title", "caf\u00e9".encode()),
        (b"connection", b"keep-alive"),  # hop-by-hop: not forwarded
        (b"content-length", b"8"),
    ]
    target = b"/v1/completions?a=1&b=%2F&c=%C3%A9"
    async with engine(answer) as seen, front(seen.port, close_engine_connections=closes) as port:
        client = await Client.open(port)
        status, headers, body = await client.exchange(b"POST", target, client_headers, b'{"x": 1}')
        # What aiohttp would add by itself (User-Agent, Accept, Accept-Encoding,
        # Content-Type, Content-Length) is not added to a request without them.
        bare = await client.exchange(b"GET", b"/health", [(b"authorization", AUTH)])
        await client.close()
    assert (status, body) == (201, b'{"x": 1}') and (b"x-engine", b"yes") in headers
    assert bare[0] == 201 and (b"content-length", b"0") in bare[1] and bare[2] == b""
    first, second = seen.requests
    host = (b"host", b"127.0.0.1:%d" % seen.port)
    assert first.line == b"POST " + target + b" HTTP/1.1"
    # The pass-through's own hop: kept alive between the two, or for llama.cpp
    # a connection per request (issue 23 item 13).
    close = [(b"connection", b"close")] if closes else []
    assert first.headers == [host, *client_headers[:-2], client_headers[-1], *close]
    assert first.body == b'{"x": 1}'
    assert (second.line, second.headers) == (
        b"GET /health HTTP/1.1",
        [host, client_headers[0], *close],
    )
    assert seen.connections == (2 if closes else 1)


async def test_a_stream_is_relayed_chunk_by_chunk() -> None:
    """The engine sends each event only once the client holds the one before:
    a relay that buffered would wait for more forever (and time out)."""
    events = [b"data: %d\n\n" % i for i in range(5)]
    received = [asyncio.Event() for _ in events]

    async def stream(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(reader)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n")
        for event, got in zip(events, received, strict=True):
            w.write(b"%x\r\n%s\r\n" % (len(event), event))
            await w.drain()
            await got.wait()
        w.write(b"0\r\n\r\n")
        await w.drain()
        await read_request(reader)

    async with engine(stream) as seen, front(seen.port) as port:
        client = await Client.open(port)
        client.send(b"POST", b"/v1/completions", [(b"host", b"n"), (b"authorization", AUTH)])
        async with asyncio.timeout(10):
            status, headers = await client.head()
            assert (b"content-type", b"text/event-stream") in headers
            for event, got in zip(events, received, strict=True):
                assert await client.chunk() == event
                got.set()
            assert await client.chunk() == b""  # the end, relayed as the end
        await client.close()
    assert status == 200


async def test_a_compressed_answer_passes_undecoded() -> None:
    payload = json.dumps({"text": "x" * 1000}).encode()
    packed = gzip.compress(payload)

    async def gzipped(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            headers = [(b"content-encoding", b"gzip"), (b"content-length", b"%d" % len(packed))]
            w.write(response(200, headers, packed))

    async with engine(gzipped) as seen, front(seen.port) as port:
        client = await Client.open(port)
        auth = [(b"authorization", AUTH), (b"accept-encoding", b"gzip")]
        status, headers, body = await client.exchange(b"GET", b"/v1/models", auth)
        await client.close()
    assert status == 200 and body == packed and gzip.decompress(body) == payload
    assert (b"content-encoding", b"gzip") in headers
    assert (b"content-length", b"%d" % len(packed)) in headers


async def test_a_redirect_is_relayed_not_followed() -> None:
    async def moved(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            headers = [(b"location", b"/elsewhere"), (b"content-length", b"0")]
            w.write(response(307, headers, b""))

    async with engine(moved) as seen, front(seen.port) as port:
        client = await Client.open(port)
        status, headers, _ = await client.exchange(
            b"GET", b"/v1/models", [(b"authorization", AUTH)]
        )
        await client.close()
    assert status == 307 and (b"location", b"/elsewhere") in headers
    assert [r.line for r in seen.requests] == [b"GET /v1/models HTTP/1.1"]


@pytest.mark.parametrize("method", [b"GET", b"POST"])
@pytest.mark.parametrize(("drops", "status"), [(1, 200), (2, 502)])
@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("closes", [False, True])
async def test_a_connection_the_engine_dropped_is_retried_once(
    method: bytes, drops: int, status: int, reset: bool, closes: bool
) -> None:
    """The engine closes the second request's connection without answering
    (the kept-alive one the first left, as an engine's idle timeout does; or
    its own, for llama.cpp: issue 23 item 13), or resets it (llama-server's
    keep-alive limit, seen under `llmgw bench`), and the retry on a new
    connection is dropped too when ``drops`` is 2."""

    async def flaky(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            if 2 <= len(seen.requests) <= 1 + drops:
                if reset:  # RST, not FIN: the client's read fails with ECONNRESET
                    rst(w)
                return  # closed, no answer
            w.write(response(200, [(b"content-length", b"2")], b"ok"))

    async with engine(flaky) as seen, front(seen.port, close_engine_connections=closes) as port:
        client = await Client.open(port)
        auth = [(b"authorization", AUTH)]
        first = await client.exchange(method, b"/v1/completions", auth, b"{}")
        second = await client.exchange(method, b"/v1/completions", auth, b"{}")
        await client.close()
    assert first[0] == 200
    assert second[0] == status
    if status == 502:
        error = json.loads(second[2])["error"]["message"]
        assert error == (
            "engine unreachable: " + ("ClientOSError" if reset else "ServerDisconnectedError")
        )
    assert len(seen.requests) == 3  # once more, never more
    assert seen.connections == (3 if closes else 2)


async def test_an_engine_that_is_down_or_garbled_is_a_502() -> None:
    async def garbled(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(reader)
        w.write(b"NOT HTTP AT ALL\r\n\r\n")

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        async with front(closed.getsockname()[1]) as port:
            client = await Client.open(port)
            down = await client.exchange(b"GET", b"/health", [(b"authorization", AUTH)])
            await client.close()
    async with engine(garbled) as seen, front(seen.port) as port:
        client = await Client.open(port)
        bad = await client.exchange(b"GET", b"/health", [(b"authorization", AUTH)])
        await client.close()
    for status, headers, body in (down, bad):
        assert status == 502 and (b"content-type", b"application/json") in headers
        assert json.loads(body)["error"]["message"].startswith("engine unreachable: ")
    assert json.loads(down[2])["error"]["message"].endswith("ClientConnectorError")


@pytest.mark.parametrize("when", ["before the answer", "mid-stream"])
async def test_a_client_that_goes_away_cancels_the_engine_request(when: str) -> None:
    """The engine keeps its request open and sends nothing more: only the
    pass-through closing the engine connection ends it."""
    reached = asyncio.Event()
    engine_saw_close = asyncio.Event()

    async def stall(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            if len(seen.requests) > 1:  # the next client's: answered
                w.write(response(200, [(b"content-length", b"2")], b"ok"))
                continue
            if when == "mid-stream":
                w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                w.write(b"9\r\ndata: 0\n\n\r\n")
                await w.drain()
            reached.set()
            if await reader.read() == b"":  # EOF: the pass-through closed the connection
                engine_saw_close.set()
            return

    async with engine(stall) as seen, front(seen.port) as port:
        client = await Client.open(port)
        client.send(b"POST", b"/v1/completions", [(b"host", b"n"), (b"authorization", AUTH)])
        async with asyncio.timeout(10):
            await reached.wait()
            if when == "mid-stream":
                assert (await client.head())[0] == 200
                assert await client.chunk() == b"data: 0\n\n"
            await client.close()
            await engine_saw_close.wait()
        # The pass-through goes on serving.
        again = await Client.open(port)
        answer = await again.exchange(b"GET", b"/health", [(b"authorization", AUTH)])
        await again.close()
    assert (answer[0], answer[2]) == (200, b"ok")
    assert len(seen.requests) == 2


async def test_the_engine_gets_its_own_key_never_the_replica_key() -> None:
    """Every engine runs as one user and can read another's environ: the engine
    holds a loopback key of its own, and the replica key never reaches it."""

    async def answer(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            w.write(response(200, [(b"content-length", b"2")], b"ok"))

    async with engine(answer) as seen, front(seen.port, engine_key="loopback-only") as port:
        client = await Client.open(port)
        headers = [(b"x-before", b"1"), (b"authorization", AUTH), (b"x-after", b"2")]
        status, _, _ = await client.exchange(b"GET", b"/slots", headers)
        refused, _, _ = await client.exchange(
            b"GET", b"/slots", [(b"authorization", b"Bearer loopback-only")]
        )
        await client.close()
    assert (status, refused) == (200, 401)
    [request] = seen.requests
    assert request.headers[1:] == [
        (b"x-before", b"1"),
        (b"authorization", b"Bearer loopback-only"),
        (b"x-after", b"2"),
    ]
    assert KEY.encode() not in request.line + b"".join(v for _, v in request.headers)


def test_keys_come_on_stdin_and_stdin_is_closed_after(tmp_path: Path) -> None:
    """The agent's way: a pipe of two lines; the environment is used only when set by hand."""
    script = (
        "import os, sys\n"
        "from worker_agent.passthrough import read_keys\n"
        "print(read_keys(dict(os.environ)), os.read(0, 10))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    given = subprocess.run(
        [sys.executable, "-I", "-c", script],
        input=keys_input("replica-key", "engine-key"),
        capture_output=True, env=env, cwd=tmp_path, timeout=60, check=True,
    )  # fmt: skip
    assert given.stdout.split(b"\n")[0] == b"('replica-key', 'engine-key') b''"
    by_hand = subprocess.run(
        [sys.executable, "-I", "-c", script],
        input=b"", capture_output=True, env={**env, KEY_ENV: "k"}, timeout=60, check=True,
    )  # fmt: skip
    assert by_hand.stdout.startswith(b"('k', 'k')")
    with pytest.raises(EngineLaunchError):
        keys_input("two words", "x")
