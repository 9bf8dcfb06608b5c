"""The one client-disconnect watch (router/common/disconnect.py) that the API layer,
the admission queue, the proxy and the relay share: what it cancels, what
it lets run on, and what it leaves behind."""

import asyncio
from pathlib import Path

import pytest
from starlette.types import Message

from router.common.disconnect import cancelled_if_gone, disconnected


class Client:
    """An ASGI ``receive`` whose client leaves when told (``leave``)."""

    def __init__(self) -> None:
        self._messages: asyncio.Queue[Message] = asyncio.Queue()
        self.read = 0

    async def receive(self) -> Message:
        message = await self._messages.get()
        self.read += 1
        return message

    def send(self, message: Message) -> None:
        self._messages.put_nowait(message)

    def leave(self) -> None:
        self.send({"type": "http.disconnect"})


async def test_disconnected_returns_on_the_disconnect_and_only_then() -> None:
    client = Client()
    gone = asyncio.ensure_future(disconnected(client.receive))
    client.send({"type": "http.request", "body": b"", "more_body": False})
    async with asyncio.timeout(5):
        while client.read < 1:
            await asyncio.sleep(0)
    assert not gone.done()  # another message is not the disconnect
    client.leave()
    async with asyncio.timeout(5):
        await gone


async def test_a_client_that_leaves_cancels_the_block_and_the_cancellation_ends_there() -> None:
    client = Client()
    inside = asyncio.Event()
    after: list[str] = []

    async def work() -> None:
        async with cancelled_if_gone(lambda: disconnected(client.receive)) as watch:
            inside.set()
            await asyncio.Event().wait()  # an engine that never answers
            after.append("the block finished")  # never
        after.append(f"left={watch.left} cut={watch.cut}")

    task = asyncio.ensure_future(work())
    async with asyncio.timeout(5):
        await inside.wait()
        client.leave()
        await task
    assert after == ["left=True cut=True"]
    assert not task.cancelled()
    assert task.cancelling() == 0  # the cancellation it made is taken back


async def test_without_cancel_the_block_runs_to_its_end_and_learns_the_client_left() -> None:
    client = Client()
    left = asyncio.Event()
    answered = asyncio.Event()

    async def work() -> tuple[bool, bool]:
        async with cancelled_if_gone(lambda: disconnected(client.receive), cancel=False) as watch:
            client.leave()
            async with asyncio.timeout(5):
                while not watch.left:
                    await asyncio.sleep(0.001)
            left.set()
            await answered.wait()  # the engine generates on, then answers
        return watch.left, watch.cut

    task = asyncio.ensure_future(work())
    async with asyncio.timeout(5):
        await left.wait()
        answered.set()
        assert await task == (True, False)


async def test_a_client_that_stays_is_not_watched_past_the_block() -> None:
    client = Client()
    async with cancelled_if_gone(lambda: disconnected(client.receive)) as watch:
        await asyncio.sleep(0)
    client.leave()  # after the block: cancels nothing
    await asyncio.sleep(0.01)
    assert (watch.left, watch.cut) == (False, False)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_from_elsewhere_still_cancels() -> None:
    client = Client()
    inside = asyncio.Event()

    async def work() -> None:
        async with cancelled_if_gone(lambda: disconnected(client.receive)):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(work())
    async with asyncio.timeout(5):
        await inside.wait()
    task.cancel()  # a server shutting down, the client still there
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nothing_to_watch_runs_the_block_plainly() -> None:
    async with cancelled_if_gone(None) as watch:
        await asyncio.sleep(0)
    assert (watch.left, watch.cut) == (False, False)


def test_the_router_watches_the_disconnect_in_one_place() -> None:
    """The API layer, the queue, the waiting stream, the proxy and the relay
    take the watch from router/common/disconnect.py; none reads the message itself."""
    router = Path(__file__).resolve().parents[2] / "router"
    readers = sorted(
        str(p.relative_to(router))
        for p in router.rglob("*.py")
        if '"http.disconnect"' in p.read_text()
    )
    assert readers == ["common/disconnect.py"]
