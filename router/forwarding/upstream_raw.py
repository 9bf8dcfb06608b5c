"""The router's default engine client (``LLMGW_UPSTREAM_CLIENT=raw``): HTTP/1.1
on a bare ``asyncio.Protocol``.

It speaks only what the proxy needs (router/forwarding/upstream.py): one POST per
request on a kept-alive connection, the request written as one buffer, the
answer parsed by httptools (llhttp, as uvicorn uses) straight into a list of
body chunks that the reader takes as they come (or, diverted, handed on from
the read callback: router/forwarding/upstream_answer.py). No task, stream reader or
header multidict per request: aiohttp's generality was about a quarter of the
router's CPU per request (``python -m tests.bench.bench_router``).

Per connection: a request goes out, its answer is parsed, and the
connection goes back to its endpoint's pool as soon as the answer is
complete (what the reader has not taken stays with the answer). An answer
closed before its end closes the connection: the engine takes that as a
cancellation. A connection idle for ``KEEPALIVE_S`` is closed here, before
the pass-through's uvicorn would close it under a request; a reused one that
closes before answering a single byte was most likely closed that way as we
wrote: the request goes once more, on a new connection.

An engine is an untrusted byte source (issue 34): nothing is ever decoded
here, an answer with a Content-Encoding other than identity is refused at
its head, and one read whole stops at ``max_answer_bytes``.
"""

import asyncio
import errno
import socket
import ssl
from collections import deque
from collections.abc import Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from llmgw.errors import LlmgwError, UpstreamConnectError, UpstreamError, UpstreamHostGone
from router.forwarding.upstream import (
    KEEPALIVE_S,
    MAX_ANSWER_BYTES,
    UpstreamResponse,
    refused_coding,
)
from router.forwarding.upstream_answer import RawAnswer, describe

# How often idle connections are looked over for retirement.
SWEEP_S = 1.0
# Parsed URLs and encoded header sets kept (cleared past this).
MAX_CACHED = 4096
# A host that vanishes (a partition, a power loss) sends no reset: without a
# bound a request on its connection waits out the read timeout (minutes).
DEAD_PEER_S = 10.0


def _timed_out(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT


def give_up_dead_peer(sock: socket.socket, after_s: float) -> bool:
    """Fail ``sock`` with ETIMEDOUT once its peer has acknowledged nothing for
    about ``after_s``: data sent and unacknowledged (TCP_USER_TIMEOUT), or an
    idle wait for the answer whose keepalive probes go unanswered. A live
    engine that is only slow to answer acknowledges both, so it is never cut.
    ``after_s`` 0: the kernel's defaults (hours).

    Whether the bound is set: an option this platform lacks (TCP_USER_TIMEOUT
    is Linux's), or one the socket refuses, leaves the connection as it was,
    usable, with the kernel's defaults.
    """
    if after_s <= 0 or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    tcp = socket.IPPROTO_TCP
    wanted = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (tcp, getattr(socket, "TCP_KEEPIDLE", None), max(1, int(after_s / 2))),
        (tcp, getattr(socket, "TCP_KEEPINTVL", None), max(1, int(after_s / 6))),
        (tcp, getattr(socket, "TCP_KEEPCNT", None), 3),
        (tcp, getattr(socket, "TCP_USER_TIMEOUT", None), int(after_s * 1000)),
    ]
    try:
        for level, option, value in wanted:
            if option is None:
                return False
            sock.setsockopt(level, option, value)
    except OSError:
        return False
    return True


_Key = tuple[str, int, bool]


class _Target:
    """What a URL gives a request, computed once per URL: its pool and request line."""

    __slots__ = ("host", "key", "line", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamConnectError(f"not an http URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.key: _Key = (self.host, self.port, self.tls)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        self.line = f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode("latin-1")


class _Conn(asyncio.Protocol):
    """One connection to an engine, and the parser of its answers."""

    def __init__(self, pool: "RawUpstream", key: _Key) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: RawAnswer | None = None
        self.reused = False
        self.lost = False
        self.pooled = False
        self.paused = False
        self.idle_since = 0.0
        self.last_read = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.codings: list[str] = []  # the answer's Content-Encoding values

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:  # nothing asked: a server that talks out of turn
            self.drop()
            return
        answer.got_bytes = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            answer.fail(exc)
            self.drop()
        if answer._sink is not None:
            answer.settle()

    def eof_received(self) -> bool | None:
        return None  # close; connection_lost says what it meant

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        answer, self.answer = self.answer, None
        self._stop_timer()
        if answer is None or answer.done:
            return
        if answer.status and not answer.framed and answer.error is None:
            answer.done = True  # a body without length ends with the connection
            answer.wake()
        elif not answer.got_bytes and self.reused and not _timed_out(exc):
            # (A timed-out one is a host gone, not an idle close: post fails over.)
            answer.fail(_Stale())
        else:
            answer.fail(exc or ConnectionError("the engine closed the connection"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        answer = self.answer
        assert answer is not None
        name = name.lower()
        if name == b"content-type":
            answer.content_type = value.decode("latin-1")
        elif name in {b"content-length", b"transfer-encoding"}:
            answer.framed = True
        elif name == b"content-encoding":
            self.codings.append(value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        answer = self.answer
        assert answer is not None
        coding = refused_coding(self.codings)
        self.codings.clear()
        if coding is not None:
            # Asked for identity, sent something else: a broken or hostile
            # engine. Refused unread, with no status (post raises the error);
            # raising stops the parser (data_received closes the connection).
            answer.fail(UpstreamError(f"Content-Encoding {coding} refused"))
            raise _Refused(coding)
        answer.status = self.parser.get_status_code()
        answer.wake()

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        assert answer is not None
        answer.add(body)

    def on_message_complete(self) -> None:
        answer = self.answer
        assert answer is not None
        answer.done = True
        answer.wake()
        answer._conn = None  # the rest of it is the answer's alone
        self.answer = None
        self._stop_timer()
        if self.paused:
            self.resume()
        if self.parser.should_keep_alive() and answer.error is None:
            # (An answer cut at its cap dropped the connection: not reused.)
            self.reused = True
            self.pool.release(self)
        else:
            self.drop()

    # Ours

    def send(self, answer: RawAnswer, data: bytes, read_timeout_s: float) -> None:
        assert self.transport is not None
        self.answer = answer
        self.last_read = self.loop.time()
        self.timer = self.loop.call_later(read_timeout_s, self._check, read_timeout_s)
        self.transport.write(data)

    def _check(self, timeout_s: float) -> None:
        """The read timeout: no byte for ``timeout_s`` while the reader waits."""
        if self.answer is None:
            return
        left = self.last_read + timeout_s - self.loop.time()
        if self.paused or left > 0:
            self.timer = self.loop.call_later(
                left if left > 0 else timeout_s, self._check, timeout_s
            )
            return
        self.answer.fail(TimeoutError(f"no answer from the engine in {timeout_s:g} s"))
        self.drop()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.last_read = self.loop.time()  # the wait was the reader's
            self.transport.resume_reading()

    def usable(self, now: float) -> bool:
        """Still open, and not idle so long that the engine may be closing it."""
        return (
            not self.lost
            and self.transport is not None
            and not self.transport.is_closing()
            and now - self.idle_since < KEEPALIVE_S
        )

    def drop(self) -> None:
        """Close it (connection_lost follows) and stop counting it as open."""
        if self.transport is not None and not self.lost:
            self.transport.close()
        self.pool.forget(self)


class _Stale(LlmgwError):
    """A reused connection closed before a byte of the answer: send once more."""


class _Refused(LlmgwError):
    """Raised in the parser's callback to stop it at an encoded answer's head."""


class RawUpstream:
    """Kept-alive connections to every engine, made on first use (in the running loop).

    ``max_connections`` bounds the open connections of all engines together;
    a request beyond waits for one to come free (an idle one to another
    engine is closed to make room).
    """

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        dead_peer_s: float = DEAD_PEER_S,
    ):
        self._max_answer = max_answer_bytes
        self._dead_peer_s = dead_peer_s
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max = max_connections
        self._idle: dict[_Key, list[_Conn]] = {}
        self._open: set[_Conn] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._targets: dict[str, _Target] = {}
        self._heads: dict[tuple[tuple[str, str], ...], bytes] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._ssl: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= MAX_CACHED:
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        request = b"".join(
            (target.line, self._head(headers), b"Content-Length: %d\r\n\r\n" % len(body), body)
        )
        fresh = False
        while True:
            conn = await self._acquire(target, fresh)
            answer = RawAnswer(conn, self._max_answer)
            conn.send(answer, request, self._read_timeout_s)
            try:
                while not answer.status:
                    if answer.error is not None:
                        raise answer.error
                    await answer.wait()
            except _Stale:
                if fresh:
                    # As a reset: the proxy drops the endpoint's proof on it.
                    closed = ConnectionResetError("closed unanswered")
                    raise UpstreamError("the engine closed the connection unanswered") from closed
                fresh = True  # once more, on a connection of its own
                continue
            except OSError as exc:  # TimeoutError too: the read timeout has no errno
                if _timed_out(exc) and not answer.got_bytes:
                    raise UpstreamHostGone(f"its host stopped answering: {describe(exc)}") from exc
                raise UpstreamError(describe(exc)) from exc
            except httptools.HttpParserError as exc:
                raise UpstreamError(describe(exc)) from exc
            except BaseException:
                conn.drop()  # cancelled (the client left): so is the engine's work
                raise
            return answer

    def _head(self, headers: Mapping[str, str]) -> bytes:
        """The header lines, encoded once per distinct set (the proxy's are per replica)."""
        items = tuple(headers.items())
        head = self._heads.get(items)
        if head is None:
            lines = []
            for name, value in items:
                if any(c in name or c in value for c in "\r\n\0") or ":" in name:
                    raise UpstreamError(f"an invalid header: {name!r}")
                if name.lower() not in ("host", "content-length", "transfer-encoding"):
                    lines.append(f"{name}: {value}\r\n")
            head = "".join(lines).encode("latin-1")
            if len(self._heads) >= MAX_CACHED:
                self._heads.clear()
            self._heads[items] = head
        return head

    async def _acquire(self, target: _Target, fresh: bool) -> _Conn:
        """An idle connection to the target (unless ``fresh``), or a new one."""
        while True:
            idle = self._idle.get(target.key)
            if idle and not fresh:
                now = self.loop.time()
                while idle:
                    conn = idle.pop()
                    conn.pooled = False
                    if conn.usable(now):
                        return conn
                    conn.drop()
            if len(self._open) < self._max or self._close_an_idle():
                return await self._connect(target)
            waiter = self.loop.create_future()
            self._waiters.append(waiter)  # _wake_one passes over a cancelled one
            await waiter  # a connection closed or came back idle

    async def _connect(self, target: _Target) -> _Conn:
        conn = _Conn(self, target.key)
        self._open.add(conn)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await self.loop.create_connection(
                    lambda: conn, target.host, target.port, ssl=self._tls() if target.tls else None
                )
        except (OSError, TimeoutError) as exc:
            self.forget(conn)
            raise UpstreamConnectError(describe(exc)) from exc
        except BaseException:
            self.forget(conn)
            raise
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            give_up_dead_peer(sock, self._dead_peer_s)
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _close_an_idle(self) -> bool:
        """Make room for a connection to one engine by closing one idle to another."""
        for idle in self._idle.values():
            if idle:
                conn = idle.pop(0)
                conn.pooled = False
                conn.drop()
                return True
        return False

    def release(self, conn: _Conn) -> None:
        """A connection done with its answer: kept for the next request to its engine."""
        conn.idle_since = self.loop.time()
        conn.pooled = True
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = []
        idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)
        self._wake_one()

    def forget(self, conn: _Conn) -> None:
        """A connection closed (or never made)."""
        if conn in self._open:
            self._open.discard(conn)
            if conn.pooled:
                conn.pooled = False
                self._idle[conn.key].remove(conn)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self) -> None:
        """Close what has been idle for KEEPALIVE_S (the oldest are first in each list)."""
        self._sweeper = None
        cutoff = self.loop.time() - KEEPALIVE_S
        left = False
        for key, idle in list(self._idle.items()):
            while idle and idle[0].idle_since <= cutoff:
                conn = idle.pop(0)
                conn.pooled = False
                conn.drop()
            if idle:
                left = True
            else:
                del self._idle[key]  # engines come and go
        if left:
            self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._open):
            conn.drop()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamConnectError("the client is closed"))
