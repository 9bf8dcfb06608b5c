"""The floor under the router's figures: the least a proxy on the same stack
does (uvicorn + httptools + uvloop serving a raw ASGI app that forwards with
aiohttp and relays the body as it comes), with no gateway work at all: no key
check, admission, accounting, metrics, tracing or routing table. What the
router adds above this is the price of being a gateway."""

from typing import Any

import aiohttp
import uvicorn

Scope = dict[str, Any]
Message = dict[str, Any]


class FloorProxy:
    """Forwards every request to ``upstream`` with the same path and body."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        while True:
            message: Message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        assert self._session is not None
        url, headers = self._upstream + scope["path"], {"content-type": "application/json"}
        async with self._session.post(url, data=body, headers=headers) as r:
            kind = r.headers.get("content-type", "application/json").encode()
            await send({"type": "http.response.start", "status": r.status,
                        "headers": [(b"content-type", kind)]})  # fmt: skip
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "lifespan.startup":
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
                )
                await send({"type": "lifespan.startup.complete"})
            else:
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def serve_floor(port: int, upstream: str) -> None:
    """Serve the floor proxy on loopback until killed."""
    uvicorn.run(FloorProxy(upstream), host="127.0.0.1", port=port, loop="uvloop",
                http="httptools", access_log=False, log_level="warning")  # fmt: skip
