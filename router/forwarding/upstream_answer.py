"""RawUpstream's answer (router/forwarding/upstream_raw.py): status and content type once
its head is parsed, then the body, either taken by a reader (whole, or
chunk by chunk through one future per wait) or diverted: handed to a sink
from the connection's read callback, one piece per read.
"""

import asyncio
from typing import Protocol

from llmgw.errors import UpstreamError
from router.forwarding.upstream import MAX_ANSWER_BYTES, Sink

# A stream's reader this far behind (bytes held unread) stops the socket
# being read until it takes them: the engine feels TCP back-pressure.
HIGH_WATER = 256 * 1024


class Connection(Protocol):
    """What an answer asks of the connection it comes on (upstream_raw's
    ``_Conn``, which makes the answer: this module does not import it)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def paused(self) -> bool: ...

    @property
    def answer(self) -> object:
        """The answer the connection is reading now (None between answers)."""
        ...

    def pause(self) -> None:
        """Stop reading the socket (the engine feels TCP back-pressure)."""
        ...

    def resume(self) -> None:
        """Read the socket again."""
        ...

    def drop(self) -> None:
        """Close the connection (the engine sees it go)."""
        ...


class RawAnswer:
    """One answer: status and content type once its head is in, then the body."""

    __slots__ = (
        "_chunks", "_conn", "_held", "_loop", "_max", "_sink", "_waiter", "_whole",
        "content_type", "done", "error", "framed", "got_bytes", "status",
    )  # fmt: skip

    def __init__(self, conn: Connection, max_bytes: int = MAX_ANSWER_BYTES) -> None:
        self._conn: Connection | None = conn
        self._loop = conn.loop
        self._whole = False  # read whole: never paused
        self._max = max_bytes  # the most ``read`` holds (router/forwarding/upstream.py)
        self._chunks: list[bytes] = []
        self._held = 0  # bytes in _chunks
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None  # diverted: the body goes there, read by read
        self.status = 0
        self.content_type = "application/json"
        self.done = False
        self.error: BaseException | None = None
        self.framed = False  # a content-length or chunked body (else: until close)
        self.got_bytes = False

    def wake(self) -> None:
        if self._sink is not None:
            self.settle()
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def add(self, chunk: bytes) -> None:
        if self.error is not None:
            return  # refused (past the cap): nothing more is kept
        self._chunks.append(chunk)
        if self._sink is not None:
            return  # handed on once the read is parsed (settle): one piece per read
        self._held += len(chunk)
        if self._held > HIGH_WATER and not self._whole and self._conn is not None:
            self._conn.pause()
        if self._whole and self._held > self._max:
            # Read whole, and past what any engine's answer holds: cut here,
            # in the read callback, before the next read adds to it.
            self._chunks = []
            self._held = 0
            self.fail(UpstreamError(f"an answer longer than {self._max} bytes"))
            if self._conn is not None:
                self._conn.drop()
            return
        self.wake()

    def fail(self, error: BaseException) -> None:
        if not self.done and self.error is None:
            self.error = error
            self.wake()

    async def wait(self) -> None:
        """Until something new: a head, a chunk, the end or an error."""
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._held = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    def settle(self) -> None:
        """Diverted: what the read brought goes to the sink as one piece, then
        the end (after the last piece) once the answer is complete or broken."""
        sink = self._sink
        if sink is None:
            return
        chunks = self._chunks
        if chunks:
            self._chunks = []
            sink.data(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        if self.done or self.error is not None:
            self._sink = None
            sink.end(None if self.error is None else UpstreamError(describe(self.error)))

    # UpstreamResponse

    async def read(self) -> bytes:
        self._whole = True
        if self._conn is not None and self._conn.paused:
            self._conn.resume()
        while not self.done and self.error is None:
            await self.wait()
        if self.error is not None:  # also when the end came after it (the cap)
            raise UpstreamError(describe(self.error))
        return self._take() if self._chunks else b""

    def chunks(self) -> "RawAnswer":
        return self

    def __aiter__(self) -> "RawAnswer":
        return self

    async def __anext__(self) -> bytes:
        # Everything that came in since the last step, as one chunk: a reader
        # that lags writes fewer, larger pieces instead of falling further behind.
        while not self._chunks:
            if self.done:
                raise StopAsyncIteration
            if self.error is not None:
                raise UpstreamError(describe(self.error))
            await self.wait()
        return self._take()

    # Divertible

    def divert(self, sink: Sink) -> None:
        """From now on the body goes to ``sink`` from the connection's read
        callback (what came before, at once): no reader, no wake-up per read."""
        self._whole = False
        self._held = 0
        self._sink = sink
        self.resume()  # held back for a lagging reader: the sink decides now
        self.settle()

    def pause(self) -> None:
        if self._conn is not None:
            self._conn.pause()

    def resume(self) -> None:
        if self._conn is not None and self._conn.paused:
            self._conn.resume()

    def close(self) -> None:
        self._sink = None  # nothing more is handed on
        conn, self._conn = self._conn, None
        if conn is not None and conn.answer is self:
            conn.drop()  # unfinished: the engine sees the connection go


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
