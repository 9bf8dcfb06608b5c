"""Forwarding a request to a replica's engine, streamed or not.

The client's body goes upstream byte for byte (unknown fields included) and
the engine's answer, SSE included, comes back byte for byte. The client's
Authorization never reaches the engine: the router sends the replica's own
engine key instead. A connection failure before any byte was sent to the
client fails over to the next replica.
"""

import logging
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from router.errors import OpenAIError, no_ready_replica, upstream_failed
from router.routing import Route, RoutingTable

log = logging.getLogger(__name__)

EngineKeyFn = Callable[[str], str]


class Proxy:
    """Sends inference requests to engines."""

    def __init__(
        self, http: httpx.AsyncClient, table: RoutingTable, engine_key: EngineKeyFn
    ) -> None:
        self._http = http
        self._table = table
        self._engine_key = engine_key

    async def forward(self, model: str, path: str, body: bytes, stream: bool) -> Response:
        """Send ``body`` to a ready replica of ``model`` at ``path``."""
        candidates = self._table.candidates(model)
        if not candidates:
            raise no_ready_replica(model)
        last_error = "no replica tried"
        for route in candidates:
            try:
                return await self._try(route, path, body, stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing reached the client yet: another replica may answer.
                last_error = f"{route.replica_id}: {type(exc).__name__}"
                log.warning("replica %s unreachable, failing over: %s", route.replica_id, exc)
        raise upstream_failed(last_error)

    async def _try(self, route: Route, path: str, body: bytes, stream: bool) -> Response:
        request = self._http.build_request(
            "POST",
            f"{route.endpoint}{path}",
            content=body,
            headers={
                "Authorization": f"Bearer {self._engine_key(route.replica_id)}",
                "Content-Type": "application/json",
            },
        )
        route.inflight += 1
        try:
            upstream = await self._http.send(request, stream=True)
        except BaseException:
            route.inflight -= 1
            raise
        if upstream.status_code == 401:
            await upstream.aclose()
            route.inflight -= 1
            # The engine refused our key: a router/agent secret mismatch, not the client's fault.
            log.error("replica %s rejected the engine key", route.replica_id)
            raise upstream_failed("the engine refused the router's key")
        headers = {"x-llmgw-replica": route.replica_id}
        media = upstream.headers.get("content-type", "application/json")
        if stream and upstream.status_code == 200:
            return StreamingResponse(_relay(upstream, route), media_type=media, headers=headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            raise upstream_failed(type(exc).__name__) from exc
        finally:
            await upstream.aclose()
            route.inflight -= 1
        return Response(
            content=content, status_code=upstream.status_code, media_type=media, headers=headers
        )


async def _relay(upstream: httpx.Response, route: Route) -> AsyncIterator[bytes]:
    """Pass SSE bytes through; closing here cancels the upstream request when
    the client goes away (Starlette stops iterating and closes the generator)."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("stream from %s broke: %s", route.replica_id, exc)
    finally:
        await upstream.aclose()
        route.inflight -= 1


__all__ = ["OpenAIError", "Proxy"]
