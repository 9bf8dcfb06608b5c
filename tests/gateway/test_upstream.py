"""The router's engine clients (RawUpstream, the default, and AiohttpUpstream)
against real loopback servers: every test runs against both.

Each server is a few lines of asyncio speaking HTTP/1.1, so a test can say
exactly when bytes go out and when the connection closes.
"""

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from llmgw.errors import UpstreamConnectError, UpstreamError
from router.forwarding.upstream import AiohttpUpstream, Upstream, UpstreamResponse
from router.forwarding.upstream_answer import RawAnswer as _RawAnswer
from router.forwarding.upstream_raw import RawUpstream, _Conn
from tests.harness import reset

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Client = Callable[..., Upstream]
MiB = 1024 * 1024


@pytest.fixture(params=["raw", "aiohttp"])
def client(request: pytest.FixtureRequest) -> Client:
    """A factory of the client under test."""
    kind = AiohttpUpstream if request.param == "aiohttp" else RawUpstream
    defaults = {"connect_timeout_s": 2, "read_timeout_s": 10, "max_connections": 8}
    return lambda **settings: kind(**{**defaults, **settings})


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[str]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(srv.wait_closed(), 5)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and Content-Length body); b"" when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def answer(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


async def test_answer_read_whole_with_our_headers_and_body(client: Client) -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(answer(b'{"ok":1}'))
        await writer.drain()
        writer.close()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b'{"a":1}', {"Authorization": "Bearer k"})
        assert response.status == 200
        assert response.content_type == "application/json"
        assert await response.read() == b'{"ok":1}'
        response.close()
    await up.aclose()
    assert seen[0].startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in seen[0]
    assert seen[0].endswith(b'\r\n\r\n{"a":1}')


async def test_nobody_listening_is_a_connect_error(client: Client) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        up = client()
        with pytest.raises(UpstreamConnectError):
            await up.post(f"http://127.0.0.1:{port}/v1/x", b"{}", {})
        await up.aclose()


async def test_chunks_arrive_as_the_engine_sends_them_and_close_cancels(client: Client) -> None:
    first_read = asyncio.Event()
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        event = b"data: 1\n\n"
        writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
        await writer.drain()
        await first_read.wait()  # the second event only once the first was relayed
        writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
        await writer.drain()
        # The client stops reading: its close must reach us as end of stream.
        await reader.read()
        closed.set()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b"{}", {})
        assert response.content_type == "text/event-stream"
        got = []
        async for chunk in response.chunks():
            got.append(chunk)
            first_read.set()
            if len(got) == 2:
                break
        assert got == [b"data: 1\n\n", b"data: 1\n\n"]
        response.close()  # before the end: the connection goes
        await asyncio.wait_for(closed.wait(), 5)
    await up.aclose()


async def test_engine_breaking_off_mid_answer_is_an_upstream_error(client: Client) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"partial')
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b"{}", {})
        with pytest.raises(UpstreamError):
            await response.read()
        response.close()
    await up.aclose()


@pytest.mark.parametrize("rst", [False, True])
async def test_a_kept_alive_connection_closed_under_a_request_is_retried_once(
    client: Client, rst: bool
) -> None:
    """The server reads the second request on a reused connection and closes it
    (or resets it) without answering, as a keep-alive timeout or limit does as
    a request arrives: the request goes again on a new connection, answered."""
    connections = 0
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while request := await read_request(reader):
            requests.append(request)
            if connections == 1 and len(requests) == 2:
                reset(writer) if rst else writer.close()  # read, never answered
                return
            writer.write(answer(b"%d" % len(requests)))
            await writer.drain()
        writer.close()

    up = client()
    async with server(handle) as url:
        for expect in (b"1", b"3"):
            response = await up.post(f"{url}/v1/x", b"{}", {})
            assert await response.read() == expect
            response.close()
    await up.aclose()
    assert connections == 2 and len(requests) == 3


async def test_a_request_refused_twice_by_disconnects_fails(client: Client) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()  # never answers anyone

    up = client()
    async with server(handle) as url:
        with pytest.raises(UpstreamError) as info:
            await up.post(f"{url}/v1/x", b"{}", {})
        assert not isinstance(info.value, UpstreamConnectError)
    await up.aclose()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def test_a_chunked_answer_read_whole(client: Client) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(chunked(b'{"a":', b"1", b"}"))
        await writer.drain()
        await reader.read()  # the connection stays for the next request
        writer.close()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b"{}", {})
        assert response.content_type == "application/json"  # none sent: the default
        assert await response.read() == b'{"a":1}'
        response.close()
        await up.aclose()


async def test_answers_in_turn_share_one_kept_alive_connection(client: Client) -> None:
    connections = 0
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while request := await read_request(reader):
            seen.append(request)
            if len(seen) % 2:
                writer.write(answer(b"%d" % len(seen)))
            else:  # every other one chunked
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                writer.write(chunked(b"%d" % len(seen)))
            await writer.drain()
        writer.close()

    up = client()
    async with server(handle) as url:
        for n in range(1, 7):
            response = await up.post(f"{url}/v1/x", b"%d" % n, {})
            got = b"".join([c async for c in response.chunks()]) if n > 3 else await response.read()
            assert got == b"%d" % n
            response.close()
        await up.aclose()
    assert connections == 1
    assert [r.rsplit(b"\r\n\r\n", 1)[1] for r in seen] == [b"%d" % n for n in range(1, 7)]


async def test_an_idle_connection_the_engine_closed_is_not_used(client: Client) -> None:
    """The engine closes a kept-alive connection while it is idle (its keep-alive
    ran out): the next request goes on a new connection, answered."""
    connections = 0
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(answer(b"%d" % connections))
        await writer.drain()
        writer.close()  # kept alive by the answer's word, closed nonetheless
        await writer.wait_closed()
        closed.set()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b"{}", {})
        assert await response.read() == b"1"
        response.close()
        await closed.wait()
        response = await up.post(f"{url}/v1/x", b"{}", {})
        assert await response.read() == b"2"
        response.close()
        await up.aclose()
    assert connections == 2


async def test_a_request_cancelled_before_its_answer_closes_the_connection(client: Client) -> None:
    """The client left while the engine worked (the proxy cancels the post):
    the engine sees its connection close, as llama.cpp and vLLM need to stop."""
    received = asyncio.Event()
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        received.set()
        assert await reader.read() == b""  # never answered: the client closes
        closed.set()
        writer.close()

    up = client()
    async with server(handle) as url:
        post = asyncio.ensure_future(up.post(f"{url}/v1/x", b"{}", {}))
        await received.wait()
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
        await asyncio.wait_for(closed.wait(), 5)
        await up.aclose()


async def test_large_bodies_both_ways(client: Client) -> None:
    body = bytes(range(256)) * (8 * MiB // 256)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            got = request.split(b"\r\n\r\n", 1)[1]
            writer.write(answer(got[::-1], b"application/octet-stream"))
            await writer.drain()
        writer.close()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", body, {})
        assert await response.read() == body[::-1]
        response.close()
        response = await up.post(f"{url}/v1/x", body, {})
        assert b"".join([c async for c in response.chunks()]) == body[::-1]
        response.close()
        await up.aclose()


def reading(response: UpstreamResponse) -> bool:
    """Whether the client still reads the answer's socket (or stopped: back-pressure)."""
    transport: asyncio.Transport | None
    if isinstance(response, _RawAnswer):
        conn = response._conn  # the answer knows it only as a Connection
        assert isinstance(conn, _Conn) and conn.transport is not None
        transport = conn.transport
    else:
        connection = response._r.connection  # type: ignore[attr-defined]
        transport = connection.transport
    assert transport is not None
    return transport.is_reading()


async def test_a_slow_reader_stops_the_engine_then_gets_every_byte(client: Client) -> None:
    """A stream's reader that lags: the client stops reading the socket (the
    engine's writes back up) instead of holding the answer in memory; then the
    reader takes it all, in order."""
    pieces = [bytes([i]) * 64 * 1024 for i in range(256)]  # 16 MiB in all

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b"{}", {})

        async def paused() -> None:
            while reading(response):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(paused(), 10)
        got = bytearray()
        async for chunk in response.chunks():
            got += chunk
            await asyncio.sleep(0)  # a reader with other work
        assert bytes(got) == b"".join(pieces)
        response.close()
        await up.aclose()


def test_the_default_client_on_uvloop_the_routers_loop() -> None:
    """The router runs on uvloop (its transports are not asyncio's classes):
    the exchanges above, once there, in a loop of its own."""
    uvloop = pytest.importorskip("uvloop")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await read_request(reader):
            body = request.split(b"\r\n\r\n", 1)[1]
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(chunked(body, body))
            await writer.drain()
        writer.close()

    async def scenario() -> list[bytes]:
        up = RawUpstream(connect_timeout_s=2, read_timeout_s=10, max_connections=8)
        got = []
        async with server(handle) as url:
            for n in range(3):
                response = await up.post(f"{url}/v1/x", b"%d" % n, {})
                got.append(b"".join([c async for c in response.chunks()]))
                response.close()
            response = await up.post(f"{url}/v1/x", b"w", {})
            got.append(await response.read())
            response.close()
            await up.aclose()
        return got

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(scenario()) == [b"00", b"11", b"22", b"ww"]


async def test_an_engine_silent_past_the_read_timeout_is_an_upstream_error(client: Client) -> None:
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # never answers; returns when the client gives up
        done.set()
        writer.close()

    up = client(read_timeout_s=0.2)
    async with server(handle) as url:
        with pytest.raises(UpstreamError) as info:
            await up.post(f"{url}/v1/x", b"{}", {})
        assert not isinstance(info.value, UpstreamConnectError)
        await asyncio.wait_for(done.wait(), 5)  # and the connection is gone
        await up.aclose()


async def test_past_max_connections_a_request_waits_for_one(client: Client) -> None:
    """One connection allowed: concurrent requests to one engine take turns on
    it; one to another engine closes the idle one to make room."""
    up = client(max_connections=1)
    connections = 0
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while request := await read_request(reader):
            await release.wait()
            writer.write(answer(request.rsplit(b"\r\n\r\n", 1)[1]))
            await writer.drain()
        writer.close()

    async def ask(url: str, body: bytes) -> bytes:
        response = await up.post(f"{url}/v1/x", body, {})
        try:
            return await response.read()
        finally:
            response.close()

    async with server(handle) as a, server(handle) as b:
        asks = [asyncio.ensure_future(ask(a, b"%d" % n)) for n in range(3)]
        release.set()
        assert await asyncio.gather(*asks) == [b"0", b"1", b"2"]
        assert connections == 1
        assert await ask(b, b"b") == b"b"
        assert await ask(a, b"a") == b"a"
        await up.aclose()
    # RawUpstream counts idle connections too: the one to the first engine
    # was closed for the second's (aiohttp counts only those in use).
    assert connections == (3 if isinstance(up, RawUpstream) else 2)
