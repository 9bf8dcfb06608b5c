"""The pass-through's own rules, driven as an ASGI app in front of a scripted upstream:
every path needs the key, what passes is relayed as is, and a client that goes away
stops the relay (so the engine's connection closes and it aborts the generation)."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from worker_agent.passthrough import PassThrough

KEY = "llmgw-engine-test"
TOTAL_CHUNKS = 500


class _Upstream:
    """An engine stand-in: echoes what it got, or streams chunks slowly."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []
        self.streamed = 0

    async def _chunks(self) -> AsyncIterator[bytes]:
        for i in range(TOTAL_CHUNKS):
            self.streamed += 1
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.01)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.content)
        if request.url.path == "/stream":
            return httpx.Response(200, content=self._chunks())
        body = {"path": request.url.path, "query": request.url.query.decode()}
        # A stream, as from a socket: the relay reads raw chunks.
        return httpx.Response(
            200, content=_once(json.dumps(body).encode()), headers={"x-engine": "yes"}
        )


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _scope(path: str, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": headers,
    }


async def _call(
    app: PassThrough, scope: dict[str, Any], disconnect_after: int | None = None
) -> list[dict[str, Any]]:
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "http.request", "body": b'{"x": 1}', "more_body": False})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return await inbox.get()

    async def send(message: Any) -> None:
        sent.append(dict(message))
        chunks = sum(1 for m in sent if m["type"] == "http.response.body")
        if disconnect_after is not None and chunks == disconnect_after:
            await inbox.put({"type": "http.disconnect"})

    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[_Upstream, PassThrough]]:
    fake = _Upstream()
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    yield fake, PassThrough("http://engine", KEY, http)
    await http.aclose()


@pytest.mark.parametrize("path", ["/v1/completions", "/invocations", "/adapters", "/metrics"])
@pytest.mark.parametrize("auth", [None, b"Bearer wrong", b"Bearer " + KEY.encode() + b"x", b""])
async def test_every_path_needs_the_key(
    upstream: tuple[_Upstream, PassThrough], path: str, auth: bytes | None
) -> None:
    fake, app = upstream
    headers = [] if auth is None else [(b"authorization", auth)]
    sent = await _call(app, _scope(path, headers))
    assert sent[0]["status"] == 401
    assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    assert fake.requests == []  # nothing reached the engine


async def test_with_the_key_the_request_and_answer_pass_unchanged(
    upstream: tuple[_Upstream, PassThrough],
) -> None:
    fake, app = upstream
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"host", b"node:1")]
    sent = await _call(app, _scope("/v1/models", headers, b"a=1"))
    assert sent[0]["status"] == 200 and (b"x-engine", b"yes") in sent[0]["headers"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert json.loads(body) == {"path": "/v1/models", "query": "a=1"}
    (forwarded,) = fake.requests
    assert forwarded.headers["authorization"] == f"Bearer {KEY}"  # the engine checks it too
    assert fake.bodies == [b'{"x": 1}']


async def test_a_client_that_goes_away_stops_the_stream(
    upstream: tuple[_Upstream, PassThrough],
) -> None:
    fake, app = upstream
    headers = [(b"authorization", f"Bearer {KEY}".encode())]
    sent = await _call(app, _scope("/stream", headers), disconnect_after=3)
    assert sum(1 for m in sent if m["type"] == "http.response.body") <= 4
    assert fake.streamed < 10 < TOTAL_CHUNKS


@pytest.mark.parametrize(("drops", "status"), [(1, 200), (2, 502)])
async def test_a_connection_the_engine_dropped_is_retried_once(drops: int, status: int) -> None:
    fake = _Upstream()
    calls: list[httpx.Request] = []

    async def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= drops:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return await fake.handle(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(flaky)) as http:
        app = PassThrough("http://engine", KEY, http)
        headers = [(b"authorization", f"Bearer {KEY}".encode())]
        sent = await _call(app, _scope("/v1/completions", headers))
    assert sent[0]["status"] == status
    assert len(calls) == 2  # once more, never more
