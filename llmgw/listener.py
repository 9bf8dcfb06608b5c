"""Limits on llmgw's HTTP listeners (the router and the engine pass-through).

Both are served by uvicorn, which bounds nothing a slow client controls: its
httptools protocol arms no timer on a new connection until a first response
is sent (only the keep-alive timer exists), so a client that connects and
sends nothing, or a request line one byte a minute, holds a socket forever;
llhttp puts no bound on the size of a request head; and
``limit_concurrency`` only answers 503 once a request's head is complete, so
half-open connections are never refused. A thousand such connections cost
the attacker nothing and the server a file descriptor each.

So the listeners run a small subclass of uvicorn's ``HttpToolsProtocol``
(uvicorn 0.55, httptools a hard dependency) that adds:

* a header-read timeout: from accept, or from the first byte of the next
  request on a kept-alive connection, until the head is complete; past it the
  connection is closed;
* a bound on a request head's size (431 and closed);
* a body-read timeout: from the end of the head until the body is complete;
  past it the client gets 408 in the OpenAI error format (when nothing of a
  response was sent yet) and the connection is closed, and the request's
  app sees the client gone. Without it a body trickled a byte at a time held
  its connection and its request task for as long as the client liked, the
  header and keep-alive timeouts notwithstanding (uvicorn drops the
  keep-alive timer at every byte received, even of a body it discards);
* a cap on open connections: one more is aborted as soon as it is accepted
  (log lines rate-limited);
* a cap on open connections per client address (off where 0): so that one
  client cannot hold every slot of the cap above. Behind a proxy every
  client has its address: raise it or turn it off there;

and the idle keep-alive timeout is uvicorn's own ``timeout_keep_alive``.
A subclass rather than an asyncio guard around the server: the parser's own
callbacks say when a head starts and ends, and when a body does. What it
adds per request is two time stamps set and cleared (no timer, no task, no
extra read of the socket); one sweep a second, while connections are open,
closes those whose head or body is late, so either gets between its timeout
and a second more. The router's hot path stays as it was.
"""

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# How often late heads are looked for: a head may take up to this much more
# than the header timeout.
_SWEEP_S = 1.0

# What a process holds besides client connections (engine connections are
# counted by the caller): logs, the store, Temporal, the loop's own.
_FD_RESERVE = 64

_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-length: 0\r\nconnection: close\r\n\r\n"
)


def _timeout_response(timeout_s: float) -> bytes:
    """408 with an OpenAI error body (both listeners serve OpenAI clients)."""
    body = json.dumps(
        {
            "error": {
                "message": f"The request body did not arrive within {timeout_s:g} s.",
                "type": "invalid_request_error",
                "param": None,
                "code": "body_timeout",
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )


@dataclass(frozen=True)
class ListenerLimits:
    """What one client connection may hold, and how many may be open."""

    header_timeout_s: float = 10.0
    # From the end of the head to the end of the body.
    body_timeout_s: float = 60.0
    # uvicorn's timeout_keep_alive is whole seconds.
    keepalive_timeout_s: int = 5
    max_connections: int = 4096
    # Per client address; 0: no cap (the pass-through's one client is the router).
    max_connections_per_client: int = 0
    max_header_bytes: int = 64 * 1024


class _Throttled:
    """One warning per ``every_s``, with the count since the last one."""

    def __init__(self, every_s: float = 10.0) -> None:
        self._every_s = every_s
        self._last = -every_s
        self._count = 0

    def warn(self, message: str) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self._every_s:
            log.warning("%s (%d since the last warning)", message, self._count)
            self._last, self._count = now, 0


class _LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (see the module docstring)."""

    limits: ClassVar[ListenerLimits]
    refused: ClassVar[_Throttled]
    refused_client: ClassVar[_Throttled]
    # Open connections per client address (only while a per-client cap is set).
    per_client: ClassVar[dict[str, int]]
    # One sweep per server (a class per server: see limited_protocol).
    sweep: ClassVar[asyncio.TimerHandle | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # When the head being read began (loop time); None between requests.
        self._head_since: float | None = None
        self._head_bytes = 0
        # When the body being read began (the head's end); None when none is.
        self._body_since: float | None = None
        # The client address counted in per_client (None: not counted).
        self._counted: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.refused.warn(f"{self.limits.max_connections} connections open: refusing more")
            # abort, not close: the descriptor is freed now, and the client
            # sees a reset rather than a server that stopped answering.
            transport.abort()
            return
        cap = self.limits.max_connections_per_client
        if cap and self.client is not None:
            host = self.client[0]
            if self.per_client.get(host, 0) >= cap:
                self.refused_client.warn(f"{cap} connections open from {host}: refusing more")
                transport.abort()
                return
            self.per_client[host] = self.per_client.get(host, 0) + 1
            self._counted = host
        self._head_since = self.loop.time()
        self._head_bytes = 0
        cls = type(self)
        if cls.sweep is None:
            cls.sweep = self.loop.call_later(_SWEEP_S, _sweep, cls, self.loop, self.connections)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted is not None:
            left = self.per_client[self._counted] - 1
            if left:
                self.per_client[self._counted] = left
            else:
                del self.per_client[self._counted]
            self._counted = None
        self._body_since = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Still reading a head after parsing: everything received so far is head.
        if self._head_since is not None:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
                self._head_since = None
                self.transport.write(_TOO_LARGE)
                self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_since is None:  # a kept-alive connection's next request
            self._head_since = self.loop.time()
            self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._head_since = None
        self._body_since = self.loop.time()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_since = None
        super().on_message_complete()

    def body_late(self) -> None:
        """The body took too long: 408 unless a response has begun, then closed;
        the request's app reads the client as gone."""
        self._body_since = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self.transport.write(_timeout_response(self.limits.body_timeout_s))
        if cycle is not None and not cycle.response_complete:
            # Nothing the app sends from now on is written after the 408.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def _sweep(cls: type[_LimitedProtocol], loop: asyncio.AbstractEventLoop, open_: set[Any]) -> None:
    """Close every connection whose head is late, answer 408 and close those whose
    body is late; again in a second while any is open."""
    now = loop.time()
    late = now - cls.limits.header_timeout_s
    body_late = now - cls.limits.body_timeout_s
    for conn in list(open_):
        if not isinstance(conn, _LimitedProtocol):  # the set may hold uvicorn's websockets
            continue
        if conn.transport.is_closing():
            continue
        since = conn._head_since
        if since is not None and since <= late:
            conn._head_since = None
            conn.transport.close()
        elif conn._body_since is not None and conn._body_since <= body_late:
            conn.body_late()
    cls.sweep = loop.call_later(_SWEEP_S, _sweep, cls, loop, open_) if open_ else None


def limited_protocol(limits: ListenerLimits) -> type[asyncio.Protocol]:
    """The HTTP protocol class to give uvicorn (``http=``) for ``limits``."""

    class LimitedHttpToolsProtocol(_LimitedProtocol):
        pass

    LimitedHttpToolsProtocol.limits = limits
    LimitedHttpToolsProtocol.refused = _Throttled()
    LimitedHttpToolsProtocol.refused_client = _Throttled()
    LimitedHttpToolsProtocol.per_client = {}
    return LimitedHttpToolsProtocol


def fit_open_files(limits: ListenerLimits, other_fds: int = 0) -> ListenerLimits:
    """``limits``, after raising this process's open-file limit to hold them.

    The soft RLIMIT_NOFILE is often 1024, below the connection cap: past it
    accept() fails with EMFILE and asyncio stops accepting for a second at a
    time, which is the outage the cap exists to prevent. So the soft limit is
    raised toward the hard one, and where even that is too low the cap is
    lowered to fit (with a warning).
    """
    needed = limits.max_connections + other_fds + _FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            log.warning("could not raise the open-file limit to %d: %s", target, err)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return limits
    fits = max(1, soft - other_fds - _FD_RESERVE)
    log.warning(
        "open-file limit %d (hard %d): at most %d client connections instead of %d",
        soft,
        hard,
        fits,
        limits.max_connections,
    )
    return replace(limits, max_connections=fits)
