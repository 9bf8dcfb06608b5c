"""The listener's body timeout (llmgw/listener.py) on a bare ASGI app served by
uvicorn in process: what the router and the engine pass-through both get.

A body that is not complete in time gets 408 in the OpenAI error format and
its app sees the client gone; a body the app never reads (it answered
early, as for a bad key) no longer keeps its connection open by trickling,
which uvicorn alone allowed (every byte received cancels its keep-alive
timer)."""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.types import Receive, Scope, Send

from llmgw.listener import ListenerLimits, limited_protocol
from tests.harness import free_port

BODY_TIMEOUT_S = 1.0
MARGIN_S = 10.0
HEAD = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"


class App:
    """Reads the body of /x (noting what it got); answers /early at once."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/x":
            while (message := await receive())["type"] == "http.request":
                if not message.get("more_body"):
                    break
            self.ended.append(message["type"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def serving(app: App) -> AsyncIterator[int]:
    port = free_port()
    limits = ListenerLimits(body_timeout_s=BODY_TIMEOUT_S, header_timeout_s=60)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http=limited_protocol(limits),
        timeout_keep_alive=60, lifespan="off",
        timeout_graceful_shutdown=2,  # a failed test's open connection must not hold it
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def trickle_until_closed(writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> bytes:
    """Send a byte every 0.2 s until the server closes; what it sent."""
    got = b""
    async with asyncio.timeout(BODY_TIMEOUT_S + MARGIN_S):
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), 0.2)
            except TimeoutError:
                writer.write(b"a")  # the body goes on, a byte at a time
                continue
            if not chunk:
                return got
            got += chunk


async def test_a_late_body_gets_408_and_its_app_sees_the_client_gone() -> None:
    app = App()
    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b"{")
        started = asyncio.get_running_loop().time()
        got = await trickle_until_closed(writer, reader)
        assert asyncio.get_running_loop().time() - started >= BODY_TIMEOUT_S
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "body_timeout")
        assert app.ended == ["http.disconnect"]
        writer.close()


async def test_a_body_trickled_after_an_early_answer_is_cut_off() -> None:
    async with serving(App()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD.replace(b"/x", b"/early") + b"{")
        got = await trickle_until_closed(writer, reader)
        # The app's own answer, and no 408 after it: the connection is closed.
        assert got.startswith(b"HTTP/1.1 200") and b"408" not in got, got[:300]
        writer.close()


async def test_a_body_in_time_is_served() -> None:
    app = App()
    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b"x" * 100)
        async with asyncio.timeout(MARGIN_S):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert app.ended == ["http.request"]
        writer.close()
