"""The routers, as the exec queue's activities reach them: HTTP with the exec token.

Split from activities/control/jobs.py (the activities): every call a job
makes to a router goes through :class:`RouterClient`, which holds the URLs
of ``LLMGW_ROUTER_URLS`` and moves to the next one on a connection error.
"""

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from llmgw.engine_keys import exec_token


class RouterClient:
    """The routers' URLs, with the exec token; on a connection error the
    next URL is tried (another router serves as well as the first)."""

    def __init__(
        self,
        urls: list[str],
        secret: Callable[[], Awaitable[str]],
        http: httpx.AsyncClient | None = None,
    ) -> None:
        if not urls:
            raise ValueError("no router URL")
        self._urls = urls
        self._next = 0
        self._secret = secret
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def headers(self, key_id: int, **extra: str) -> dict[str, str]:
        """A call's headers as the job's key ``key_id``: the exec token is
        bound to it (a router lets it act as no other key)."""
        token = exec_token(await self._secret(), key_id)
        return {"Authorization": f"Bearer {token}", "X-Llmgw-Key-Id": str(key_id), **extra}

    def _url(self, path: str) -> str:
        return self._urls[self._next % len(self._urls)] + path

    def _rotate(self) -> None:
        self._next += 1

    async def post(self, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
        """POST to a router; httpx.TransportError once every URL failed to connect."""
        last: httpx.TransportError | None = None
        for _ in range(len(self._urls)):
            try:
                return await self._http.post(self._url(path), json=body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                last = exc
                self._rotate()
        assert last is not None
        raise last

    @contextlib.asynccontextmanager
    async def stream(self, path: str, headers: dict[str, str]) -> AsyncIterator[httpx.Response]:
        """A streamed POST to a router (the next URL on a connection error)."""
        last: httpx.TransportError | None = None
        for _ in range(len(self._urls)):
            try:
                async with self._http.stream(
                    "POST", self._url(path), headers=headers, json={}
                ) as response:
                    yield response
                    return
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = exc
                self._rotate()
        assert last is not None
        raise last

    async def aclose(self) -> None:
        await self._http.aclose()
