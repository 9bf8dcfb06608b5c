"""A response body into the partial file: large reads here, hashing and writing beside.

Done in one thread, a fetch ran at 0.22x ``curl -o`` on loopback: h11
parsed 64 KiB reads (copying each twice), then sha256, the write and at the
end one fsync of the whole file ran in turn. Here the calling thread only
reads; beside it (``BodySink``) one thread appends and asks the kernel to
start writing back each window as it fills, so the closing fsync finds little
left, and another hashes the same buffers. hashlib and ``os.write`` release
the GIL for large buffers, so the three overlap. Memory is bounded: a pool of
at most ``BUFFERS`` buffers of ``chunk_bytes`` cycles between them.

A large body over HTTP/1.x with a Content-Length is read straight from the
connection's socket with ``recv_into`` into those buffers: httpx still sends
the request, follows redirects, does TLS and parses the headers. After the
headers h11 may hold the start of the body; its first Data event hands all it
holds (h11's Content-Length reader takes the whole buffer), so that chunk is
taken through httpx first and the socket is read after it. Were that ever
not so, the bytes would be out of order and the digest check would refuse
them (tests/agent/test_fetch_body.py guards the case). A connection read
this way ends outside h11's sight, so httpcore closes it rather than reuse
it: a body smaller than one buffer, which gains nothing, goes through httpx.

A buffer is handed to the writer full, or once the socket has nothing to
read, or ``HOLD_S`` after its first byte: bytes received reach the partial
file soon, so a process killed while its source pauses or trickles loses
little of what it was sent.
"""

import contextlib
import ctypes
import hashlib
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from types import TracebackType

import httpx

from llmgw.errors import LlmgwError

BUFFERS = 8
HOLD_S = 0.2
# Written back in windows this size; the writer waits for the window before
# the last, so dirty pages stay under two windows and the fsync is short.
WRITEBACK_BYTES = 32 * 2**20

_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4

Received = Callable[[int], None]


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's sync_file_range(2), which the os module lacks; None elsewhere (the
    closing fsync alone then writes the file back)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_RANGE = _sync_file_range()


class _Item:
    """Bytes put, and the pooled buffer holding them: back in the pool once both
    the writer and the hasher are done with it."""

    __slots__ = ("buffer", "data", "users")

    def __init__(self, data: memoryview | bytes, buffer: bytearray | None) -> None:
        self.data = data
        self.buffer = buffer
        self.users = 2


class BodySink:
    """Appends ``data`` to ``fd`` in one thread and hashes it into ``digest`` in
    another, each in the order put: sha256 and the page-cache copy each take
    about half a second a GiB here, so they run side by side. ``close`` (or
    leaving the ``with``) waits until all put is written and hashed; a write's
    error is raised there or by the next ``put``."""

    def __init__(self, fd: int, offset: int, digest: "hashlib._Hash", buffer_bytes: int) -> None:
        self._fd = fd
        self._digest = digest
        self._written = offset
        self._kicked = offset  # where the writeback not yet asked for starts
        self._buffer_bytes = buffer_bytes
        self._made = 0  # buffers made: none for a body read through httpx
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._release_lock = threading.Lock()
        # Bounded, so chunks that come without a pooled buffer are bounded too.
        self._to_write: queue.Queue[_Item | None] = queue.Queue(maxsize=BUFFERS)
        self._to_hash: queue.Queue[_Item | None] = queue.Queue(maxsize=BUFFERS)
        self._failure: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._run_writes, name="fetch-writer", daemon=True),
            threading.Thread(target=self._run_hashes, name="fetch-hasher", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def buffer(self) -> bytearray:
        """A pooled buffer to fill, given back with ``put``; waits while all are in use."""
        if self._made < BUFFERS and self._free.empty():
            self._made += 1
            return bytearray(self._buffer_bytes)
        return self._free.get()

    def put(self, data: memoryview | bytes, buffer: bytearray | None = None) -> None:
        """Write and hash ``data``; ``buffer`` (holding it) returns to the pool after."""
        self._raise_failure()
        item = _Item(data, buffer)
        self._to_write.put(item)
        self._to_hash.put(item)

    def close(self) -> None:
        self._to_write.put(None)
        self._to_hash.put(None)
        for thread in self._threads:
            thread.join()
        self._raise_failure()

    def __enter__(self) -> "BodySink":
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
            return
        # Already failing: write what was put (bytes kept for a resume), raise the first error.
        with contextlib.suppress(Exception):
            self.close()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _release(self, item: _Item) -> None:
        with self._release_lock:
            item.users -= 1
            last = item.users == 0
        if last and item.buffer is not None:
            self._free.put(item.buffer)

    def _run_writes(self) -> None:
        while (item := self._to_write.get()) is not None:
            if self._failure is None:
                try:
                    self._write(item.data)
                except BaseException as exc:  # raised in the reading thread
                    self._failure = exc
            self._release(item)  # after a failure too: the reader may wait for its buffer

    def _run_hashes(self) -> None:
        while (item := self._to_hash.get()) is not None:
            self._digest.update(item.data)
            self._release(item)

    def _write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self._written += len(data)
        if _SYNC_RANGE is not None and self._written - self._kicked >= WRITEBACK_BYTES:
            start, self._kicked = self._kicked, self._written
            # A hint: an error here shows again, and is raised, at the closing fsync.
            _SYNC_RANGE(self._fd, start, self._written - start, _SYNC_FILE_RANGE_WRITE)
            if start >= WRITEBACK_BYTES:
                _SYNC_RANGE(
                    self._fd,
                    start - WRITEBACK_BYTES,
                    WRITEBACK_BYTES,
                    _SYNC_FILE_RANGE_WAIT_BEFORE
                    | _SYNC_FILE_RANGE_WRITE
                    | _SYNC_FILE_RANGE_WAIT_AFTER,
                )


class BodyTooLong(LlmgwError):
    """The source sent more bytes than the pin's size (caught by http_file,
    which reports the file as a FileMismatch)."""


def receive(
    response: httpx.Response,
    sink: BodySink,
    *,
    limit: int,
    buffer_bytes: int,
    timeout_s: float,
    received: Received,
) -> None:
    """Every byte of ``response``'s body to ``sink``; ``received(n)`` after each
    read (it may raise, e.g. at a deadline). BodyTooLong past ``limit`` bytes;
    httpx's errors for a stall (ReadTimeout), a cut or a short body."""
    length = response.headers.get("content-length", "")
    sock = _socket_of(response) if length.isdigit() and int(length) > buffer_bytes else None
    if sock is None or not isinstance(response.stream, httpx.SyncByteStream):
        got = 0
        for chunk in response.iter_raw():
            got += len(chunk)
            if got > limit:
                raise BodyTooLong
            sink.put(chunk)
            received(len(chunk))
        return
    # The part of the body h11 read with the headers, or its first read.
    chunks = iter(response.stream)
    first = next(chunks, b"")
    if len(first) > int(length):
        raise BodyTooLong
    sink.put(first)
    received(len(first))
    _from_socket(sock, sink, int(length) - len(first), timeout_s, received)
    del chunks  # held until now: dropping it earlier would close the connection


def _socket_of(response: httpx.Response) -> socket.socket | None:
    """The socket a plain HTTP/1.x body can be read from, or None."""
    if response.http_version not in ("HTTP/1.1", "HTTP/1.0"):
        return None  # HTTP/2 multiplexes streams on one socket
    if "transfer-encoding" in response.headers:
        return None
    if response.headers.get("content-encoding", "identity") != "identity":
        return None
    stream = response.extensions.get("network_stream")
    if stream is None:  # a transport without one (a mock, ASGI)
        return None
    sock = stream.get_extra_info("socket")
    if not isinstance(sock, socket.socket):
        return None
    if stream.get_extra_info("ssl_object") is not None and not isinstance(sock, ssl.SSLSocket):
        return None  # TLS done above the socket (TLS in TLS, through an HTTPS proxy)
    return sock


def _from_socket(
    sock: socket.socket, sink: BodySink, left: int, timeout_s: float, received: Received
) -> None:
    sock.settimeout(timeout_s)
    poller = select.poll()
    poller.register(sock, select.POLLIN)

    def readable(wait_s: float) -> bool:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True  # decrypted bytes wait in the TLS layer, not the socket
        return bool(poller.poll(max(0, int(wait_s * 1000))))

    buffer = sink.buffer()
    view = memoryview(buffer)
    held = 0
    hand_by = 0.0
    try:
        while left:
            if held:
                now = time.monotonic()
                if held == len(buffer) or now >= hand_by or not readable(hand_by - now):
                    sink.put(view[:held], buffer)
                    held = 0
                    buffer = sink.buffer()
                    view = memoryview(buffer)
            try:
                got = sock.recv_into(view[held:], min(len(buffer) - held, left))
            except TimeoutError:
                raise httpx.ReadTimeout("no byte within the read timeout") from None
            except OSError as exc:
                raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from None
            if not got:
                raise httpx.RemoteProtocolError(f"the connection closed {left} bytes short")
            if not held:
                hand_by = time.monotonic() + HOLD_S
            held += got
            left -= got
            received(got)
    finally:
        if held:  # bytes received are kept, whatever ended the read
            sink.put(view[:held], buffer)
