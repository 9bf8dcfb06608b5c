"""The router's engine client (aiohttp) against real loopback servers.

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
from router.upstream import AiohttpUpstream
from tests.harness import reset

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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


def client() -> AiohttpUpstream:
    return AiohttpUpstream(connect_timeout_s=2, read_timeout_s=10, max_connections=8)


async def test_answer_read_whole_with_our_headers_and_body() -> None:
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
        await response.close()
    await up.aclose()
    assert seen[0].startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in seen[0]
    assert seen[0].endswith(b'\r\n\r\n{"a":1}')


async def test_nobody_listening_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        up = client()
        with pytest.raises(UpstreamConnectError):
            await up.post(f"http://127.0.0.1:{port}/v1/x", b"{}", {})
        await up.aclose()


async def test_chunks_arrive_as_the_engine_sends_them_and_close_cancels() -> None:
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
        await response.close()  # before the end: the connection goes
        await asyncio.wait_for(closed.wait(), 5)
    await up.aclose()


async def test_engine_breaking_off_mid_answer_is_an_upstream_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    up = client()
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b"{}", {})
        with pytest.raises(UpstreamError):
            await response.read()
        await response.close()
    await up.aclose()


@pytest.mark.parametrize("rst", [False, True])
async def test_a_kept_alive_connection_closed_under_a_request_is_retried_once(rst: bool) -> None:
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
            await response.close()
    await up.aclose()
    assert connections == 2 and len(requests) == 3


async def test_a_request_refused_twice_by_disconnects_fails() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()  # never answers anyone

    up = client()
    async with server(handle) as url:
        with pytest.raises(UpstreamError) as info:
            await up.post(f"{url}/v1/x", b"{}", {})
        assert not isinstance(info.value, UpstreamConnectError)
    await up.aclose()
