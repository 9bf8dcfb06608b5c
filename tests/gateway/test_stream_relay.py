"""The stream relay with RawUpstream's diverted body: the engine's reads go
to the client from the connection's read callback (router.forwarding.relay.Pour).

First the client alone (``RawUpstream``'s answer handing its body to a
sink), then a real router process (served as ``llmgw router`` serves it:
``python -m tests.bench.bench_router _router URL``) with
``LLMGW_UPSTREAM_CLIENT=raw``, in front of an engine scripted per test on
loopback, read by a raw HTTP/1.1 client so a test sees the router's writes
(one HTTP chunk each) as they are.
"""

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Message

from llmgw.errors import UpstreamError
from llmgw.store import Store
from router.api.apikeys import create_key
from router.billing import usage
from router.billing.accounting import RequestOutcome
from router.billing.bill import Bill
from router.billing.key_policy import KeyPolicy
from router.common.metrics import Metrics
from router.control_link.routing import Route, RoutingTable
from router.forwarding.call import Call
from router.forwarding.engine_stream import Relay as _Relay
from router.forwarding.pacing import Pacer
from router.forwarding.upstream import Divertible, Sink
from router.forwarding.upstream_raw import RawUpstream
from tests.bench.fasthttp import MODEL, request_bytes
from tests.bench.procs import free_port, spawn, stop, wait_http
from tests.gateway.test_upstream import read_request, server

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

# Not kept alive: each test's engine script has the connection to itself.
HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
)
END = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """One HTTP chunk, as an engine writes each event."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token(text: str = "x") -> bytes:
    choice = {"index": 0, "delta": {"content": text}}
    return event({"object": "chat.completion.chunk", "choices": [choice]})


FINISH = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
USAGE = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
DONE = b"data: [DONE]\n\n"
CAP = 8192  # events of 16 kB the late reader's engine writes at most


class Recorder:
    """Records what a diverted answer hands on, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.ended = asyncio.Event()
        self.got = asyncio.Event()

    def data(self, piece: bytes) -> None:
        self.calls.append(("data", piece))
        self.got.set()

    def end(self, error: UpstreamError | None) -> None:
        self.calls.append(("end", error))
        self.ended.set()


@contextlib.asynccontextmanager
async def answer(handle: Script) -> AsyncIterator[tuple[Divertible, str]]:
    """RawUpstream's answer from an engine scripted by ``handle`` (and its URL);
    closed, with the client, when the block ends."""
    up = RawUpstream(connect_timeout_s=2, read_timeout_s=10, max_connections=4)
    async with server(handle) as url:
        response = await up.post(f"{url}/v1/x", b"{}", {})
        assert isinstance(response, Divertible)
        try:
            yield response, url
        finally:
            response.close()
    await up.aclose()


async def test_a_diverted_answer_hands_each_read_on_whole_then_its_end() -> None:
    go_on = asyncio.Event()
    first = [token("a"), token("b"), token("c")]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # The head and three events (three HTTP chunks) in one write: one read.
        writer.write(HEAD + b"".join(chunk(e) for e in first))
        await writer.drain()
        await go_on.wait()
        writer.write(chunk(FINISH) + chunk(DONE) + END)
        await writer.drain()
        await reader.read()

    async with answer(handle) as (response, _):
        sink = Recorder()
        response.divert(sink)
        async with asyncio.timeout(10):
            await sink.got.wait()
        assert sink.calls == [("data", b"".join(first))]  # what came before, at once
        go_on.set()
        async with asyncio.timeout(10):
            await sink.ended.wait()
        assert sink.calls[1:] == [("data", FINISH + DONE), ("end", None)]


async def test_a_diverted_answer_broken_off_ends_with_an_upstream_error_after_its_data() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(token()))
        await writer.drain()
        writer.close()  # mid-body: the chunked body never ends

    async with answer(handle) as (response, _):
        sink = Recorder()
        response.divert(sink)
        async with asyncio.timeout(10):
            await sink.ended.wait()
    assert sink.calls[0] == ("data", token())
    assert sink.calls[-1][0] == "end" and isinstance(sink.calls[-1][1], UpstreamError)
    assert len(sink.calls) == 2


class Watched:
    """The real answer, its pauses and resumes recorded (what the relay asks of it)."""

    def __init__(self, inner: Divertible) -> None:
        self.inner = inner
        self.log: list[str] = []

    def divert(self, sink: Sink) -> None:
        self.inner.divert(sink)

    def pause(self) -> None:
        self.log.append("pause")
        self.inner.pause()

    def resume(self) -> None:
        self.log.append("resume")
        self.inner.resume()

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


def billed_to(outcomes: list[RequestOutcome]) -> Bill:
    """A bill whose outcome lands in ``outcomes``."""
    bill = Bill()
    bill.then(outcomes.append)
    return bill


async def test_a_send_the_client_cannot_take_yet_pauses_the_engine_until_it_has_gone() -> None:
    go_on = asyncio.Event()
    blocked = asyncio.Event()
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    bodies: list[bytes] = []
    outcomes: list[RequestOutcome] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(token("a")))
        await writer.drain()
        await go_on.wait()
        writer.write(chunk(token("b")) + chunk(FINISH) + chunk(DONE) + END)
        await writer.drain()

    async def send(message: Message) -> None:
        """A client whose socket is full until ``gate``: as uvicorn's send waits to drain."""
        if message["type"] == "http.response.body":
            bodies.append(message["body"])
            if len(bodies) == 1:
                blocked.set()
                await gate

    async with answer(handle) as (response, url):
        watched = Watched(response)
        call = Call(MODEL, "/v1/x", b"{}", True, True, billed_to(outcomes), time.monotonic())
        relay = _Relay(watched, Route("r", MODEL, url), call, Metrics(RoutingTable()))  # type: ignore[arg-type]
        pump = asyncio.ensure_future(relay.pump(send, []))
        async with asyncio.timeout(10):
            await blocked.wait()
            assert watched.log == ["pause"]  # with the send, not after it
            go_on.set()
            gate.set_result(None)
            await pump
    assert watched.log == ["pause", "resume"]
    assert bodies == [token("a"), token("b") + FINISH + DONE, b""]
    assert [(o.completion_tokens, o.error) for o in outcomes] == [(2, False)]


async def test_a_busy_loop_holds_a_fast_stream_s_reads_once_its_first_token_is_out() -> None:
    bodies: list[bytes] = []
    relayed = [asyncio.Event() for _ in range(4)]  # relayed[n]: n + 1 bodies sent
    engine_wrote = asyncio.Event()
    outcomes: list[RequestOutcome] = []
    pacer = Pacer()
    pacer.window = 1.5  # as router.forwarding.pacing keeps it for a busy loop
    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # Each event once the one before is relayed: one read each, fast.
        for n, piece in enumerate((HEAD + chunk(role), chunk(role), chunk(token("a")))):
            writer.write(piece)
            await writer.drain()
            await relayed[n].wait()
        # Three writes, each its own read were the connection read at once.
        for piece in (chunk(token("b")), chunk(token("c")), chunk(FINISH) + chunk(DONE) + END):
            writer.write(piece)
            await writer.drain()
        engine_wrote.set()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])
            if len(bodies) <= len(relayed):
                relayed[len(bodies) - 1].set()

    async with answer(handle) as (response, url):
        watched = Watched(response)
        call = Call(MODEL, "/v1/x", b"{}", True, True, billed_to(outcomes), time.monotonic())
        route = Route("r", MODEL, url)
        relay = _Relay(watched, route, call, Metrics(RoutingTable()), pacer)  # type: ignore[arg-type]
        pump = asyncio.ensure_future(relay.pump(send, []))
        async with asyncio.timeout(10):
            await relayed[1].wait()
            assert watched.log == []  # no token yet (role-only events): nothing held
            await engine_wrote.wait()
            assert bodies == [role, role, token("a")]  # the first token was not held
            assert watched.log == ["pause"]  # after it, the connection is left unread
            await pump
    assert bodies == [role, role, token("a"), token("b") + token("c") + FINISH + DONE, b""]
    assert watched.log[:2] == ["pause", "resume"]
    assert [(o.completion_tokens, o.error) for o in outcomes] == [(3, False)]


# The router in front of a scripted engine -------------------------------


class Router:
    def __init__(self, port: int, store: Store) -> None:
        self.port = port
        self.store = store
        self.script: Script | None = None

    def key(self) -> tuple[int, str]:
        info, key = create_key(self.store, "relay", KeyPolicy())
        return info.id, key

    async def open(self, key: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream request sent; its answer's head read (200, chunked)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(request_bytes("/v1/chat/completions", key, True))
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        assert head.startswith(b"http/1.1 200"), head
        assert b"transfer-encoding: chunked" in head
        return reader, writer

    async def usage(self, key_id: int) -> usage.UsageRow:
        """The key's usage row once the router has flushed it."""
        async with asyncio.timeout(20):
            while True:
                rows = await asyncio.to_thread(usage.query, self.store, key_id, MODEL)
                if rows:
                    return rows[0]
                await asyncio.sleep(0.1)


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """The router's next write (one HTTP chunk); b"" at the body's end."""
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    data = await reader.readexactly(size + 2)
    return data[:-2]


async def read_rest(reader: asyncio.StreamReader) -> bytes:
    out = []
    while piece := await read_chunk(reader):
        out.append(piece)
    return b"".join(out)


@pytest.fixture(scope="module")
async def router(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Router]:
    work = tmp_path_factory.mktemp("relay")
    store_url = f"sqlite:///{work / 'store.db'}"
    store = Store(store_url)
    store.migrate()
    port = free_port()
    holder = Router(port, store)

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        assert holder.script is not None
        try:
            await holder.script(reader, writer)
        finally:
            writer.close()

    async with server(engine) as url:
        env = dict(
            os.environ,
            LLMGW_STORE_URL=store_url,
            LLMGW_PORT=str(port),
            LLMGW_UPSTREAM_CLIENT="raw",
            LLMGW_USAGE_FLUSH_INTERVAL_S="0.2",
        )
        proc = spawn(
            [sys.executable, "-m", "tests.bench.bench_router", "_router", url],
            env,
            work / "router.log",
        )
        try:
            loaded = b'"routing_table_loaded":true'
            up = await asyncio.to_thread(wait_http, port, "/healthz", lambda d: loaded in d, 60)
            assert up, Path(work / "router.log").read_text()[-2000:]
            yield holder
        finally:
            await asyncio.to_thread(stop, proc)
            store.close()


async def test_what_one_engine_read_brings_goes_out_as_one_write_byte_for_byte(
    router: Router,
) -> None:
    relayed = asyncio.Event()
    three = [token("a"), token("b"), token("c")]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + b"".join(chunk(e) for e in three))  # one write, three events
        await writer.drain()
        await relayed.wait()
        writer.write(chunk(token("d")) + chunk(FINISH) + chunk(USAGE) + chunk(DONE) + END)
        await writer.drain()
        await reader.read()

    router.script = script
    key_id, key = router.key()
    reader, writer = await router.open(key)
    async with asyncio.timeout(20):
        assert await read_chunk(reader) == b"".join(three)
        relayed.set()
        rest = await read_rest(reader)
    writer.close()
    # The usage the router asked for is billed, not shown (the client did not ask).
    assert rest == token("d") + FINISH + DONE
    row = await router.usage(key_id)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (1, 5, 4)


async def test_a_client_that_reads_late_gets_every_byte_in_order(
    router: Router,
) -> None:
    backed_up = asyncio.Event()
    sent: list[bytes] = []
    big = token("y" * 16_000)  # one token each, 16 kB

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        # Until our own buffer fills: the router is behind or has stopped
        # reading us (its client reads nothing); the pause itself is pinned
        # by the test above, this one that every byte comes through in order.
        for _ in range(CAP):
            writer.write(chunk(big))
            sent.append(big)
            await asyncio.sleep(0)
            if writer.transport.get_write_buffer_size() > 1024 * 1024:
                break
        backed_up.set()
        writer.write(chunk(FINISH) + chunk(DONE) + END)
        await writer.drain()
        await reader.read()

    router.script = script
    key_id, key = router.key()
    reader, writer = await router.open(key)
    async with asyncio.timeout(60):
        await backed_up.wait()
        assert len(sent) < CAP, "the engine was never held back by 128 MiB"
        body = await read_rest(reader)
    writer.close()
    assert body == b"".join(sent) + FINISH + DONE
    row = await router.usage(key_id)
    assert row.completion_tokens == len(sent)  # counted, the engine sent no usage


async def test_a_client_gone_mid_stream_closes_the_engine_and_bills_what_was_sent(
    router: Router,
) -> None:
    engine_saw_close = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(token()) + chunk(token()))
        await writer.drain()
        writer.write(chunk(token()))
        await writer.drain()
        await reader.read()  # the router's close: end of file
        engine_saw_close.set()

    router.script = script
    key_id, key = router.key()
    reader, writer = await router.open(key)
    got = b""
    async with asyncio.timeout(20):
        while got.count(b"\n\n") < 3:
            got += await read_chunk(reader)
        writer.close()
        await engine_saw_close.wait()
    assert got == token() * 3
    row = await router.usage(key_id)
    assert (row.requests, row.completion_tokens) == (1, 3)


async def test_chunks_with_usage_null_pass_untouched_and_are_counted(router: Router) -> None:
    # Engines in OpenAI's manner put "usage":null in every chunk once usage is
    # asked for; those are ordinary events (no usage to read or strip).
    def nulled(text: str) -> bytes:
        return event({"choices": [{"index": 0, "delta": {"content": text}}], "usage": None})

    sent = [nulled("a"), nulled("b"), nulled("c")]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + b"".join(chunk(e) for e in sent))
        writer.write(chunk(FINISH) + chunk(DONE) + END)  # and no usage after all
        await writer.drain()
        await reader.read()

    router.script = script
    key_id, key = router.key()
    reader, writer = await router.open(key)
    async with asyncio.timeout(20):
        body = await read_rest(reader)
    writer.close()
    assert body == b"".join(sent) + FINISH + DONE
    row = await router.usage(key_id)
    assert row.completion_tokens == 3
