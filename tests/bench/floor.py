"""The floor under the router's figures: the least a proxy on the same stack
does (uvicorn + httptools + uvloop serving a raw ASGI app that forwards with
an HTTP client and relays the body as it comes), with no gateway work at all:
no key check, admission, accounting, metrics, tracing or routing table. What
the router adds above this is the price of being a gateway.

Two clients: aiohttp (the floor as first measured) and the router's own
``RawUpstream`` (the same client as the router's default, a fairer floor).
"""

from typing import Any

import aiohttp
import uvicorn

from router.forwarding.upstream_raw import RawUpstream

Scope = dict[str, Any]
Message = dict[str, Any]
HEADERS = {"content-type": "application/json"}


async def _body(receive: Any) -> bytes:
    body = b""
    while True:
        message: Message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


async def _lifespan(receive: Any, send: Any, start: Any, stop: Any) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "lifespan.startup":
            start()
            await send({"type": "lifespan.startup.complete"})
        else:
            await stop()
            await send({"type": "lifespan.shutdown.complete"})
            return


class FloorProxy:
    """Forwards every request to ``upstream`` with the same path and body (aiohttp)."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self._start, self._stop)
            return
        body = await _body(receive)
        assert self._session is not None
        url = self._upstream + scope["path"]
        async with self._session.post(url, data=body, headers=HEADERS) as r:
            kind = r.headers.get("content-type", "application/json").encode()
            await send({"type": "http.response.start", "status": r.status,
                        "headers": [(b"content-type", kind)]})  # fmt: skip
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
        )

    async def _stop(self) -> None:
        if self._session is not None:
            await self._session.close()


class RawFloorProxy:
    """The same with the router's ``RawUpstream``."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._client = RawUpstream(connect_timeout_s=5, read_timeout_s=600, max_connections=1024)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, lambda: None, self._client.aclose)
            return
        body = await _body(receive)
        r = await self._client.post(self._upstream + scope["path"], body, HEADERS)
        try:
            await send({"type": "http.response.start", "status": r.status,
                        "headers": [(b"content-type", r.content_type.encode())]})  # fmt: skip
            async for chunk in r.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            r.close()
        await send({"type": "http.response.body", "body": b""})


def serve_floor(port: int, upstream: str, client: str = "aiohttp") -> None:
    """Serve the floor proxy on loopback until killed."""
    app = RawFloorProxy(upstream) if client == "raw" else FloorProxy(upstream)
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop",
                http="httptools", access_log=False, log_level="warning")  # fmt: skip
