"""The client's disconnect, watched: one helper for every place that waits on it.

An ASGI server reports a client that went away as an ``http.disconnect``
message on ``receive``; once the request's body has been read, that is the
only message left to come. The API layer hands ``disconnected`` to the
request (``Call.client_gone``); the admission queue races it against a
replica freeing up; the proxy (a non-streamed request) and the relay (a
stream) run their work under ``cancelled_if_gone``, which cancels it when
the client leaves.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.types import Message, Receive


async def disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Watch:
    """What ``cancelled_if_gone`` saw: ``left`` once the client went away while
    the block ran; ``cut`` when the block was cancelled for it (it did not finish)."""

    __slots__ = ("cut", "left")

    def __init__(self) -> None:
        self.left = False
        self.cut = False


@contextlib.asynccontextmanager
async def cancelled_if_gone(
    gone: Callable[[], Awaitable[None]] | None, cancel: bool = True
) -> AsyncIterator[Watch]:
    """Run the block while one watcher task awaits ``gone()`` (the client's
    disconnect; None: nothing is watched). Once it returns, ``Watch.left`` is
    set and, with ``cancel``, the block is cancelled: that cancellation ends
    here (``Watch.cut``), and the code after the block decides what the client
    (who is no longer there) gets. Without ``cancel`` the block runs to its
    end (an engine that generates on regardless, whose answer is still billed).

    One watcher task that cancels this task, rather than a task per awaited
    step or event: the common case (the client stays) costs a task start and
    a cancel. A disconnect seen after the block ended cancels nothing.
    """
    watch = Watch()
    if gone is None:
        yield watch
        return
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(gone())
    active = True

    def leave(done: "asyncio.Future[None]") -> None:
        # The callback may run after the block ended: only cancel while inside.
        if active and not done.cancelled() and done.exception() is None:
            watch.left = True
            if cancel:
                task.cancel()

    watcher.add_done_callback(leave)
    try:
        yield watch
    except asyncio.CancelledError:
        if not watch.left:
            raise
        task.uncancel()
        watch.cut = True
    finally:
        active = False
        watcher.cancel()


def disconnect_message() -> Message:
    """The message an ASGI app reads when its client has gone: what an
    in-process caller hands an endpoint it drives once it stops listening."""
    return {"type": "http.disconnect"}
