"""The router's answers as plain ASGI: a whole one, or an engine's stream relayed.

No Starlette Response objects on the hot path: an answer is its status,
header list and body, sent in two ASGI messages. A stream (router.proxy's
relay) is written as the engine's reads come, each read one write to the
client; one task per stream watches for the client's disconnect, which
cancels the relay (nothing per event). With an engine client whose answer
is Divertible (RawUpstream) the writes are made from the engine
connection's read callback (``send_now``): no task wakes per read.
"""

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, Protocol

from starlette.types import Message, Receive, Scope, Send


class Relayed(Protocol):
    """A stream to relay (router.proxy's relay)."""

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

    def __init__(self, relay: Relayed, media: str, replica_id: str) -> None:
        self._relay = relay
        self.headers = [
            (b"x-llmgw-replica", replica_id.encode()),
            (b"content-type", media_header(media)),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _unless_gone(self._relay.pump(send, self.headers), receive)
        finally:
            await self._relay.finish()


async def _unless_gone(relay: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run the relay in this task while one watcher waits for the client's
    disconnect (a task per stream, nothing per event); a disconnect cancels it."""
    task = asyncio.current_task()
    assert task is not None
    active, left = True, False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        if active:  # not once the relay is over
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await relay
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
    except OSError:
        pass  # the server could not write to a client that left
    finally:
        active = False
        watcher.cancel()


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
