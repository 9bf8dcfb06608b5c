"""An in-process router in front of a scripted engine (httpx.MockTransport).

The router's ``Upstream`` is injected: ``MockUpstream`` hands its requests
to the scripted engine in process. The production client (aiohttp) is tested
against real servers in tests/gateway/test_upstream.py and end to end.

For the gateway's own logic (keys, quotas, usage, balancing, pass-through,
admin API) where a real engine adds nothing but time; the real llama.cpp
runs in tests/e2e/test_gateway_e2e.py.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from llmgw.errors import UpstreamConnectError, UpstreamError
from llmgw.store import Store
from llmgw.types import EngineProfile, ModelSpec, ReplicaMemo, ReplicaPhase, RoutingPolicy
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy

ADMIN_KEY = "test-admin-key"
PROMPT_TOKENS = 7


class FakeSource:
    """Replicas as a test says they are."""

    def __init__(self, replicas: list[ReplicaMemo]) -> None:
        self.items = replicas
        self.reads = 0

    async def replicas(self) -> list[ReplicaMemo]:
        self.reads += 1
        return self.items


def ready(replica_id: str, model: str, endpoint: str) -> ReplicaMemo:
    return ReplicaMemo(
        replica_id=replica_id,
        model=model,
        phase=ReplicaPhase.READY,
        node_id="n1",
        endpoint=endpoint,
    )


def sse(*objs: dict[str, Any]) -> bytes:
    """An engine's SSE stream of ``objs`` then [DONE]."""
    out = b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs)
    return out + b"data: [DONE]\n\n"


@dataclass
class MockEngine:
    """Answers like llama.cpp; records what it was sent. ``hold`` parks requests."""

    seen: list[httpx.Request] = field(default_factory=list)
    down: set[str] = field(default_factory=set)  # hosts that refuse connections
    refused: list[str] = field(default_factory=list)  # requests they refused
    hold: asyncio.Event | None = None

    def body(self, i: int = -1) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.seen[i].content)
        return data

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.down:
            self.refused.append(request.url.host)
            raise httpx.ConnectError("refused", request=request)
        self.seen.append(request)
        if self.hold is not None:
            await self.hold.wait()
        data = json.loads(request.content)
        n = min(int(data.get("max_tokens") or 3), 64)
        path = request.url.path
        if path == "/v1/embeddings":
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "model": data["model"],
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.5]}],
                    "usage": {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS},
                },
            )
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": n,
            "total_tokens": PROMPT_TOKENS + n,
        }
        if not data.get("stream"):
            return httpx.Response(
                200,
                json={
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * n}}],
                    "usage": usage,
                },
            )
        chunks: list[dict[str, Any]] = [
            {"choices": [{"index": 0, "delta": {"content": "x"}}], "object": "chunk"}
            for _ in range(n)
        ]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if (data.get("stream_options") or {}).get("include_usage"):
            chunks.append({"choices": [], "usage": usage})
        return httpx.Response(
            200, content=sse(*chunks), headers={"content-type": "text/event-stream"}
        )


_closing: set[asyncio.Future[None]] = set()


class _MockResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._r = response

    @property
    def status(self) -> int:
        return self._r.status_code

    @property
    def content_type(self) -> str:
        return str(self._r.headers.get("content-type", "application/json"))

    async def read(self) -> bytes:
        try:
            return await self._r.aread()
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from exc

    def close(self) -> None:
        # The router's close is synchronous (its real clients drop or pool the
        # connection at once); httpx's async stream closes on the next turn.
        task = asyncio.ensure_future(self._r.aclose())
        _closing.add(task)
        task.add_done_callback(_closing.discard)


class MockUpstream:
    """The router's Upstream, answered by a scripted engine in this process."""

    def __init__(self, engine: MockEngine) -> None:
        self._http = httpx.AsyncClient(transport=httpx.MockTransport(engine.handle))

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> _MockResponse:
        request = self._http.build_request("POST", url, content=body, headers=dict(headers))
        try:
            return _MockResponse(await self._http.send(request, stream=True))
        except httpx.ConnectError as exc:
            raise UpstreamConnectError(f"ConnectError: {exc}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from exc

    async def aclose(self) -> None:
        await self._http.aclose()


@dataclass
class Gateway:
    """A router app, its store, its engine and an HTTP client to it."""

    app: FastAPI
    store: Store
    engine: MockEngine
    http: httpx.AsyncClient
    # What the routing table reads: a test may change its replicas.
    source: FakeSource | None = None

    def key(self, **policy: Any) -> tuple[int, str]:
        info, key = create_key(self.store, "k", KeyPolicy(**policy))
        return info.id, key


def post_scope(path: str, key: str) -> dict[str, Any]:
    """A raw ASGI POST scope, for clients httpx cannot play (one that leaves mid-request)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {key}".encode()), (b"host", b"router")],
        "client": ("127.0.0.1", 1),
        "server": ("router", 80),
    }


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client to ``app`` running in process, once its routing table has loaded."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            async with asyncio.timeout(10):
                while not (await http.get("/healthz")).json()["routing_table_loaded"]:
                    await asyncio.sleep(0.01)
            yield http


@asynccontextmanager
async def gateway(
    db: Path | str,
    replicas: list[ReplicaMemo],
    models: list[ModelSpec],
    engine: MockEngine | None = None,
    **app_args: Any,
) -> AsyncIterator[Gateway]:
    """A running router app over a store at ``db`` (a SQLite file, or a store URL)."""
    store = Store(db if isinstance(db, str) else f"sqlite:///{db}")
    store.migrate()
    for spec in models:
        store.put_model(spec)
    engine = engine or MockEngine()
    # Quota windows follow this clock: frozen, so no test straddles a minute.
    frozen = time.time()
    app_args.setdefault("clock", lambda: frozen)
    app_args.setdefault("refresh_interval_s", 0.05)
    # The shipped bound on a store call (2 s) is for a stalled store; on a
    # loaded 2-core test machine a SQLite write can take that long now and
    # then (seen once: the admin revoke of test_revoked_key_is_refused_here_at_once
    # answered 503). The bound's own behaviour is tested with its own values
    # (tests/gateway/test_store_outage_path.py, tests/e2e/test_store_outage.py).
    app_args.setdefault("store_wait_s", 10.0)
    # The tests read which replica served (x-llmgw-replica; off by default).
    app_args.setdefault("expose_replica_header", True)
    source = FakeSource(replicas)
    app = create_app(
        store,
        source,
        http=MockUpstream(engine),
        admin_key=ADMIN_KEY,
        usage_flush_interval_s=0.05,
        **app_args,
    )
    async with serving(app) as http:
        yield Gateway(app, store, engine, http, source)
    store.close()


def spec(name: str, max_inflight: int = 0, context_length: int = 512) -> ModelSpec:
    # The engine's own slots (0), not the catalog's default four pinned ones:
    # these tests' mock engines take bodies as sent (no id_slot) and as many
    # at once as the profile allows; tests/gateway/test_affinity_slots.py and
    # test_slot_pinning.py pin slots.
    return ModelSpec(
        name=name,
        source="/m.gguf",
        context_length=context_length,
        profile=EngineProfile(max_inflight=max_inflight),
        routing=RoutingPolicy(slots=0),
    )
