"""The router's HTTP client to engines (their pass-throughs), on the hot path.

``Upstream`` is what the proxy needs: one POST whose answer is read whole or
chunk by chunk, and whose close, before the answer is complete, drops the
connection (the engine takes that as a cancellation). Failures come as
``UpstreamConnectError`` (nothing was sent: fail over) or ``UpstreamError``.

``router.forwarding.upstream_raw.RawUpstream`` is the default (about a fifth of
aiohttp's CPU per request,
25-35 vs 122-178 us against the benchmark's mock, ``python -m
tests.bench.bench_router``), and its answer is ``Divertible``: a stream's
reads go to the client from the connection's read callback.
``AiohttpUpstream`` is kept as the opt-in alternative
(``LLMGW_UPSTREAM_CLIENT=aiohttp``; aiohttp costs about a fifth of httpx's).
"""

from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Protocol, cast, runtime_checkable

import aiohttp

from llmgw.errors import UpstreamConnectError, UpstreamError

# Below uvicorn's 5 s keep-alive (the pass-through in front of every engine):
# a connection is retired here before the server closes it under a request.
KEEPALIVE_S = 4.0
# The most of a non-streamed answer read whole (``read``). An engine is an
# untrusted byte source (issue 34): without a bound, one that never ends its
# body grows the router's memory until it dies. A chat or completion answer
# is kilobytes, a large embeddings batch a few tens of MiB (2,048 inputs of
# 1,024 floats as JSON: about 40 MiB); past this only a broken or hostile
# engine. Streams are not read whole: their relay holds a read at a time.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# The only content coding asked of an engine and taken from one: a compressed
# answer would be expanded by whoever decodes it (aiohttp, by default), and a
# 590-byte stacked gzip body expands to 256 MiB in one synchronous call.
IDENTITY = "identity"


def refused_coding(values: Iterable[str]) -> str | None:
    """The content codings of ``values`` (Content-Encoding header values)
    other than identity, as one string; None when there are none."""
    codings = [c.strip().lower() for v in values for c in v.split(",")]
    refused = [c for c in codings if c not in ("", IDENTITY)]
    return ", ".join(refused) if refused else None


class UpstreamResponse(Protocol):
    """An engine's answer: status and headers are in, the body is still to read."""

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str: ...

    async def read(self) -> bytes:
        """The whole body (``UpstreamError`` if the engine breaks off, or
        sends more than the client's ``max_answer_bytes``)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (``UpstreamError`` if the engine breaks off)."""
        ...

    def close(self) -> None:
        """Done with it: a body not read to its end closes the connection.

        Synchronous: nothing to wait for (the connection goes back to the pool
        or is dropped), so a relay ending under cancellation needs no shield.
        """
        ...


class Sink(Protocol):
    """Where a diverted body goes, from the connection's read callback."""

    def data(self, chunk: bytes) -> None:
        """What one read brought (never empty); must not block or raise."""
        ...

    def end(self, error: UpstreamError | None) -> None:
        """The body is complete (None) or broke off; called once, after the last data."""
        ...


@runtime_checkable
class Divertible(Protocol):
    """An answer whose body can skip the reader: each read handed to a sink
    as it is parsed (no wake-up of a waiting task per read)."""

    def divert(self, sink: Sink) -> None:
        """Hand the body to ``sink`` from now on (what already came, at once)."""
        ...

    def pause(self) -> None:
        """Stop reading the engine (the sink's client is behind)."""
        ...

    def resume(self) -> None: ...


def divertible(response: UpstreamResponse) -> Divertible | None:
    """The answer as a Divertible when it is one: a plain attribute check, where
    isinstance on a runtime protocol costs microseconds per stream."""
    return cast(Divertible, response) if hasattr(response, "divert") else None


class Upstream(Protocol):
    """Sends one request to an engine."""

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


class _AiohttpResponse:
    def __init__(self, response: aiohttp.ClientResponse, max_bytes: int) -> None:
        self._r = response
        self._max = max_bytes

    @property
    def status(self) -> int:
        return self._r.status

    @property
    def content_type(self) -> str:
        return self._r.headers.get("Content-Type", "application/json")

    async def read(self) -> bytes:
        chunks: list[bytes] = []
        held = 0
        try:
            while chunk := await self._r.content.readany():
                held += len(chunk)
                if held > self._max:
                    self._r.close()  # the engine sees the connection go
                    raise UpstreamError(f"an answer longer than {self._max} bytes")
                chunks.append(chunk)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(_describe(exc)) from exc
        return b"".join(chunks)

    def chunks(self) -> AsyncIterator[bytes]:
        return _Chunks(self._r.content)

    def close(self) -> None:
        if self._r.content.at_eof():
            self._r.release()  # back to the pool
        else:
            self._r.close()  # the engine sees the connection go: it stops


class _Chunks:
    """A body read as it arrives: one ``readany`` per step, no generator layers
    between the socket and the relay (a stream's per-event cost)."""

    __slots__ = ("_content",)

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    def __aiter__(self) -> "_Chunks":
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(_describe(exc)) from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk


class AiohttpUpstream:
    """Kept-alive connections to every engine, made on first use (it needs the loop)."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ):
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._max = max_connections
        self._max_answer = max_answer_bytes
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max, keepalive_timeout=KEEPALIVE_S),
                timeout=self._timeout,
                # Engines set no cookies worth keeping, and one client's must
                # never reach another's request.
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",),
                # aiohttp asks for gzip and deflate and expands what comes: an
                # engine's bomb would be expanded here. Identity is asked
                # (unless the caller asks it itself) and nothing is decoded:
                # an encoded answer is refused (post).
                headers={"Accept-Encoding": IDENTITY},
                auto_decompress=False,
            )
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        session = self._open()
        for attempt in (1, 2):
            try:
                response = await session.post(url, data=body, headers=dict(headers))
                coding = refused_coding(response.headers.getall("Content-Encoding", ()))
                if coding is not None:
                    response.close()  # unread: asked for identity, sent something else
                    raise UpstreamError(f"Content-Encoding {coding} refused")
                return _AiohttpResponse(response, self._max_answer)
            except aiohttp.ServerDisconnectedError as exc:
                # Nearly always a kept-alive connection the server closed as
                # we sent (the request unread): once more on a new one. An
                # engine that died reading it refuses the second connection.
                if attempt == 2:
                    raise UpstreamError(_describe(exc)) from exc
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise UpstreamConnectError(_describe(exc)) from exc
            except aiohttp.ClientOSError as exc:
                # The same, reset instead of closed (a server past its
                # keep-alive limit): nothing was answered; once more.
                if attempt == 2:
                    raise UpstreamError(_describe(exc)) from exc
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise UpstreamError(_describe(exc)) from exc
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
