"""The router's answers as plain ASGI: a whole one, or an engine's stream relayed.

No Starlette Response objects on the hot path: an answer is its status,
header list and body, sent in two ASGI messages. A stream (router.forwarding.proxy's
relay) is written as the engine's reads come, each read one write to the
client; one task per stream watches for the client's disconnect, which
cancels the relay (nothing per event). With an engine client whose answer
is Divertible (RawUpstream) the writes are made from the engine
connection's read callback (``Pour``, ``send_now``): no task wakes per read.
"""

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Protocol

from starlette.types import Message, Receive, Scope, Send

from llmgw.errors import UpstreamError
from router.common.disconnect import cancelled_if_gone, disconnected
from router.forwarding.pacing import Pacer
from router.forwarding.upstream import Divertible


class Relayed(Protocol):
    """A stream to relay (router.forwarding.proxy's relay)."""

    async def pump(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """Answer with ``headers`` and relay the stream until it ends."""
        ...

    async def finish(self, error: bool = False) -> None:
        """Account and release, once (also when the stream never started)."""
        ...


def media_header(media: str) -> bytes:
    """A Content-Type as Starlette sent it: text types get a charset if they name none."""
    if media.startswith("text/") and "charset=" not in media.lower():
        media += "; charset=utf-8"
    return media.encode("latin-1")


class Reply:
    """A whole answer: status, headers (lower-case names) and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


class StreamReply:
    """A relayed stream as an ASGI answer; releases its relay whatever happens
    (a client gone before the first byte, or mid-stream)."""

    def __init__(
        self, relay: Relayed, media: str, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self._relay = relay
        # ``extra``: headers of the router's own (x-llmgw-replica where it is exposed).
        self.headers = [*(extra or ()), (b"content-type", media_header(media))]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The relay runs in this task while one watcher waits for the client's
        # disconnect (a task per stream, nothing per event); a disconnect cancels it.
        try:
            async with cancelled_if_gone(lambda: disconnected(receive)):
                await self._relay.pump(send, self.headers)
        except OSError:
            pass  # the server could not write to a client that left
        finally:
            await self._relay.finish()


def send_now(send: Send, message: Message) -> "asyncio.Future[None] | None":
    """Run ``send(message)`` in the caller's stack (a protocol's read callback,
    where there is no task to await in): None once it is done, which is the
    common case (the server writes to the socket and returns); else a future
    for the rest, driven by callbacks as a task would drive it (the client's
    socket is full and the server waits for it to drain). What the send
    raises before its first wait is raised here.
    """
    steps = send(message).__await__()
    try:
        waiting = steps.send(None)
    except StopIteration:
        return None
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _wait_then_step(steps, waiting, done)
    return done


def _wait_then_step(
    steps: Generator[Any, None, None], waiting: Any, done: "asyncio.Future[None]"
) -> None:
    def step(_: object = None) -> None:
        try:
            nxt = steps.send(None)
        except StopIteration:
            done.set_result(None)
        except asyncio.CancelledError:
            done.cancel()
        except BaseException as exc:  # handed to whoever awaits ``done``
            done.set_exception(exc)
        else:
            _wait_then_step(steps, nxt, done)

    if isinstance(waiting, asyncio.Future):
        # What asyncio's Task does with a future a coroutine yields.
        waiting._asyncio_future_blocking = False
        waiting.add_done_callback(step)
    else:  # a bare yield (sleep(0)): the next loop turn
        asyncio.get_running_loop().call_soon(step)


class Pour:
    """A diverted answer's sink (router.forwarding.upstream.Divertible): each engine read,
    cut at its last complete event and counted (``events``), is sent to the
    client from the read callback itself, as one write; no task wakes per
    read. A send the client's socket cannot take at once pauses the engine's
    connection until it has gone. While ``pacer`` has a window (a busy
    loop: router.forwarding.pacing), a relayed read that came within a window of the
    one before, once the stream's first token is out (``started``), also
    pauses it for that long, so the next read brings what the engine wrote
    meanwhile (a stream slower than the window gains nothing by it and is
    never held). ``over`` is done
    when the body is relayed, with the engine's break (UpstreamError) or
    the client socket's failure.
    """

    __slots__ = (
        "_ended", "_events", "_held", "_last", "_loop", "_pacer", "_send", "_sending",
        "_started", "_upstream", "over",
    )  # fmt: skip

    def __init__(
        self,
        events: Callable[[bytes], bytes],
        upstream: Divertible,
        send: Send,
        pacer: Pacer | None = None,
        started: Callable[[], bool] = lambda: True,
    ) -> None:
        self._events = events
        self._upstream = upstream
        self._send = send
        self._pacer = pacer
        self._started = started
        self._loop = asyncio.get_running_loop()
        self._sending: asyncio.Future[None] | None = None
        self._held: asyncio.TimerHandle | None = None  # the pacer's pause
        self._last = float("-inf")  # when the last read was relayed
        self._ended = False
        self.over: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        upstream.divert(self)

    def data(self, chunk: bytes) -> None:
        if self.over.done():  # failed (or cancelled): the pump is closing the answer
            return
        try:
            out = self._events(chunk)
            if not out:
                return
            sending = send_now(
                self._send, {"type": "http.response.body", "body": out, "more_body": True}
            )
        except Exception as exc:  # the client's socket failed: the pump raises it
            self.over.set_exception(exc)
            return
        if sending is not None:
            self._sending = sending
            self._upstream.pause()
            sending.add_done_callback(self._sent)
        elif self._pacer is not None and (window := self._pacer.window):
            now, last = self._loop.time(), self._last
            self._last = now
            if now - last < window and self._started():
                self._upstream.pause()
                self._held = self._loop.call_later(window, self._release)

    def end(self, error: UpstreamError | None) -> None:
        if self._held is not None:
            self._held.cancel()
            self._held = None
        if self.over.done():
            return
        if error is not None:
            self.over.set_exception(error)
        elif self._sending is None:
            self.over.set_result(None)
        else:
            self._ended = True  # once the last send has gone

    def _release(self) -> None:
        """The pacer's hold is over: read again, unless a send still waits."""
        self._held = None
        # A read that comes at once brings what waited: the stream is still
        # faster than the window, and is held again.
        self._last = self._loop.time()
        if self._sending is None and not self.over.done():
            self._upstream.resume()

    def _sent(self, sending: "asyncio.Future[None]") -> None:
        self._sending = None
        if self.over.done():
            return
        if sending.cancelled():
            self.over.cancel()
        elif (exc := sending.exception()) is not None:
            self.over.set_exception(exc)
        elif self._ended:
            self.over.set_result(None)
        elif self._held is None:
            self._upstream.resume()
