"""The gateway's logic in process, in front of a scripted engine: pass-through,
the allow-list, keys, quotas under concurrency, usage, balancing, metrics."""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from llmgw.engine_keys import engine_key
from llmgw.store import Store
from llmgw.types import EngineKind, QueuePolicy, ReplicaMemo
from router.api.apikeys import create_key, revoke_key
from router.app import create_app
from router.billing import usage
from router.billing.key_policy import KeyPolicy
from router.billing.quotas import minute_of
from tests.gateway_util import (
    ADMIN_KEY,
    PROMPT_TOKENS,
    FakeSource,
    Gateway,
    MockEngine,
    MockUpstream,
    auth,
    gateway,
    post_scope,
    ready,
    spec,
)

M = "m1"


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with gateway(
        tmp_path / "s.db",
        [ready("r1", M, "http://e1:1"), ready("r2", M, "http://e2:1")],
        [spec(M)],
    ) as g:
        yield g


def chat(**extra: object) -> dict[str, object]:
    return {"model": M, "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_unknown_fields_reach_the_engine_with_its_key_not_the_clients(gw: Gateway) -> None:
    _, key = gw.key()
    body = chat(max_tokens=2, mirostat={"tau": 5}, cache_prompt=True)
    r = await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    sent = gw.engine.seen[-1]
    assert json.loads(sent.content) == body
    replica = r.headers["x-llmgw-replica"]
    secret = gw.store.engine_key_secret()
    assert sent.headers["authorization"] == f"Bearer {engine_key(secret, replica)}"


async def test_stream_asks_the_engine_for_usage_and_hides_it(gw: Gateway) -> None:
    _, key = gw.key()
    r = await gw.http.post(
        "/v1/chat/completions", json=chat(max_tokens=3, stream=True), headers=auth(key)
    )
    assert r.status_code == 200
    assert gw.engine.body()["stream_options"] == {"include_usage": True}
    assert b"usage" not in r.content
    assert r.content.count(b"data: ") == 5  # 3 tokens, the finish chunk, [DONE]


async def test_stream_with_usage_asked_is_byte_for_byte(gw: Gateway) -> None:
    _, key = gw.key()
    body = chat(max_tokens=3, stream=True, stream_options={"include_usage": True})
    raw = json.dumps(body).encode()
    r = await gw.http.post(
        "/v1/chat/completions",
        content=raw,
        headers={**auth(key), "content-type": "application/json"},
    )
    assert gw.engine.seen[-1].content == raw  # the body itself untouched
    direct = await gw.engine.handle(
        httpx.Request("POST", "http://e1:1/v1/chat/completions", content=raw)
    )
    assert r.content == direct.content


async def test_embeddings_are_forwarded_and_billed(gw: Gateway) -> None:
    key_id, key = gw.key()
    r = await gw.http.post(
        "/v1/embeddings", json={"model": M, "input": ["a", "b"], "x": 1}, headers=auth(key)
    )
    assert r.status_code == 200
    assert r.json()["data"][0]["embedding"] == [0.5, -0.5]
    assert gw.engine.seen[-1].url.path == "/v1/embeddings"
    await gw.app.state.deps.accountant.flush()
    rows = usage.query(gw.store, key_id=key_id)
    assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        (1, PROMPT_TOKENS, 0)
    ]


@pytest.mark.parametrize(
    "path",
    [
        "/invocations",
        "/pause",
        "/update_weights",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/lora-adapters",
        "/adapters",
        "/slots",
        "/props",
        "/tokenize",
        "/v1/metrics",
        "/v1/invocations",
    ],
)
async def test_engine_paths_outside_the_allow_list_are_404(gw: Gateway, path: str) -> None:
    _, key = gw.key()
    for method in ("GET", "POST"):
        r = await gw.http.request(method, path, json={"model": M}, headers=auth(key))
        assert r.status_code in (404, 405), (method, path)
        assert "error" in r.json()
    assert gw.engine.seen == []


async def test_metrics_are_the_routers_own(gw: Gateway) -> None:
    _, key = gw.key()
    await gw.http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key))
    await gw.http.post(
        "/v1/chat/completions", json=chat(max_tokens=2, stream=True), headers=auth(key)
    )
    text = (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text
    assert 'llmgw_requests_total{endpoint="chat/completions",model="m1",status="200"} 2.0' in text
    assert f'llmgw_tokens_total{{kind="completion",model="{M}"}} 4.0' in text
    assert "llmgw_time_to_first_token_seconds_count" in text
    assert 'llmgw_replica_inflight{model="m1",replica="r1"} 0.0' in text
    assert "llmgw_stream_coalesce_window_seconds " in text
    await gw.http.post("/v1/chat/completions", json=chat(model="nope"), headers=auth(key))
    await gw.http.post("/v1/chat/completions", json=chat(), headers=auth("bad"))
    text = (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text
    assert 'llmgw_requests_total{endpoint="chat/completions",model="",status="404"} 1.0' in text
    assert 'llmgw_requests_total{endpoint="chat/completions",model="",status="401"} 1.0' in text
    assert "nope" not in text
    assert all(r.url.path != "/metrics" for r in gw.engine.seen)


async def test_key_policy(gw: Gateway) -> None:
    _, only_other = gw.key(models=["other"])
    r = await gw.http.post("/v1/chat/completions", json=chat(), headers=auth(only_other))
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert (await gw.http.get("/v1/models", headers=auth(only_other))).json()["data"] == []

    _, expired = gw.key(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    r = await gw.http.post("/v1/chat/completions", json=chat(), headers=auth(expired))
    assert r.status_code == 401 and r.json()["error"]["code"] == "expired_api_key"

    _, admin = gw.key(admin=True)
    r = await gw.http.post("/v1/chat/completions", json=chat(), headers=auth(admin))
    assert r.status_code == 401
    for bad in (ADMIN_KEY, "", "sk-llmgw-nope"):
        r = await gw.http.post("/v1/chat/completions", json=chat(), headers=auth(bad))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_revoked_key_is_refused_here_at_once(gw: Gateway) -> None:
    key_id, key = gw.key()
    assert (await gw.http.get("/v1/models", headers=auth(key))).status_code == 200  # cached now
    r = await gw.http.delete(f"/admin/keys/{key_id}", headers=auth(ADMIN_KEY))
    assert r.status_code == 200 and r.json()["revoked"] is True
    assert (await gw.http.get("/v1/models", headers=auth(key))).status_code == 401


async def test_revoked_key_is_refused_by_other_routers_within_the_cache_ttl(tmp_path: Path) -> None:
    async with gateway(
        tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [spec(M)], key_cache_ttl_s=0.2
    ) as gw:
        key_id, key = gw.key()
        assert (await gw.http.get("/v1/models", headers=auth(key))).status_code == 200
        revoke_key(gw.store, key_id)  # as another router (or the CLI) would
        async with asyncio.timeout(2):
            while (await gw.http.get("/v1/models", headers=auth(key))).status_code == 200:
                await asyncio.sleep(0.02)


async def test_bad_bodies_are_openai_shaped_400_and_413(tmp_path: Path) -> None:
    async with gateway(
        tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [spec(M)], max_request_bytes=1000
    ) as gw:
        _, key = gw.key()
        h = {**auth(key), "content-type": "application/json"}
        for content, param in [
            (b"{nope", None),
            (b"[1]", None),
            (json.dumps(chat(max_tokens="many")).encode(), "max_tokens"),
            (json.dumps(chat(messages=[])).encode(), "messages"),
            (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
        ]:
            r = await gw.http.post("/v1/chat/completions", content=content, headers=h)
            assert r.status_code == 400, content
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["param"] == param
        big = json.dumps(chat(padding="x" * 2000)).encode()
        r = await gw.http.post("/v1/chat/completions", content=big, headers=h)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert gw.engine.seen == []


async def test_request_quota_holds_across_two_routers_under_200_concurrent_requests(
    store_url: str,
) -> None:
    db = store_url
    replicas, models = [ready("r1", M, "http://e1:1")], [spec(M)]
    now = time.time()  # one clock for both routers: one quota minute

    def clock() -> float:
        return now

    async with (
        gateway(db, replicas, models, clock=clock) as a,
        gateway(db, replicas, models, clock=clock) as b,
    ):
        key_id, key = a.key(rpm=10)
        results = await asyncio.gather(
            *(
                (a if i % 2 else b).http.post(
                    "/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)
                )
                for i in range(200)
            )
        )
        await a.app.state.deps.accountant.flush()
        await b.app.state.deps.accountant.flush()
    statuses = [r.status_code for r in results]
    assert statuses.count(200) == 10  # every one admitted that fits, none more
    assert statuses.count(429) == 190
    refused = next(r for r in results if r.status_code == 429)
    # The sliding minute: into the next one until this one's 10 weigh <= 9.
    retry = int(refused.headers["retry-after"])
    assert abs(retry - (minute_of(now) * 60 + 66 - now)) <= 1, retry
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    rows = usage.query(a.store, key_id=key_id)
    assert sum(r.requests for r in rows) == 10


async def test_token_budget_is_never_overshot_by_more_than_one_reservation(
    store_url: str,
) -> None:
    engine = MockEngine(hold=asyncio.Event())
    async with gateway(store_url, [ready("r1", M, "http://e1:1")], [spec(M)], engine) as gw:
        key_id, key = gw.key(token_budget=1000)
        body = chat(max_tokens=50)  # reserves 1 + 64 + 16 + 50 = 131 tokens, uses 57
        reservation = 131
        first = [
            asyncio.create_task(gw.http.post("/v1/chat/completions", json=body, headers=auth(key)))
            for _ in range(50)
        ]
        async with asyncio.timeout(10):
            while sum(t.done() for t in first) < 50 - 1000 // reservation:
                await asyncio.sleep(0.01)
        # Every reservation held at once (the engine holds the admitted): 7 fit.
        assert len(engine.seen) == 1000 // reservation
        assert engine.hold is not None
        engine.hold.set()
        assert sum(r.status_code == 200 for r in await asyncio.gather(*first)) == 7
        # Settled with the real usage (57 each), the rest of the budget opens up again.
        await gw.app.state.deps.accountant.flush()
        while (
            r := await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
        ).status_code == 200:
            await gw.app.state.deps.accountant.flush()
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        assert int(r.headers["retry-after"]) <= 86400
        await gw.app.state.deps.accountant.flush()
        used = sum(x.prompt_tokens + x.completion_tokens for x in usage.query(gw.store, key_id))
        assert 1000 - reservation < used <= 1000 + reservation


async def test_token_per_minute_quota(gw: Gateway) -> None:
    _, key = gw.key(tpm=200)
    ok = await gw.http.post("/v1/chat/completions", json=chat(max_tokens=50), headers=auth(key))
    assert ok.status_code == 200
    held = await gw.http.post("/v1/chat/completions", json=chat(max_tokens=100), headers=auth(key))
    assert held.status_code == 429 and held.json()["error"]["type"] == "tokens"


async def test_usage_per_key_model_and_day_counts_errors(tmp_path: Path) -> None:
    engine = MockEngine(down={"e1"})
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [spec(M)], engine) as gw:
        key_id, key = gw.key()
        r = await gw.http.post("/v1/chat/completions", json=chat(), headers=auth(key))
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        engine.down.clear()
        await gw.http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(key))
        await gw.http.post(
            "/v1/completions",
            json={"model": M, "prompt": "x", "max_tokens": 2, "stream": True},
            headers=auth(key),
        )
        rows = (await gw.http.get("/admin/usage", headers=auth(ADMIN_KEY))).json()
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    assert rows == [
        {
            "key_id": key_id,
            "model": M,
            "day": today,
            "requests": 3,
            "errors": 1,
            "prompt_tokens": 2 * PROMPT_TOKENS,
            "completion_tokens": 6,
        }
    ]


async def test_failover_before_the_first_byte(tmp_path: Path) -> None:
    engine = MockEngine(down={"e1"})
    replicas = [ready("r1", M, "http://e1:1"), ready("r2", M, "http://e2:1")]
    async with gateway(tmp_path / "s.db", replicas, [spec(M)], engine) as gw:
        _, key = gw.key()
        for _ in range(4):
            r = await gw.http.post("/v1/chat/completions", json=chat(), headers=auth(key))
            assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "r2"
        text = (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text
        assert 'llmgw_upstream_errors_total{kind="connect",model="m1",replica="r1"}' in text


async def test_least_outstanding_with_a_cap_then_503(tmp_path: Path) -> None:
    engine = MockEngine(hold=asyncio.Event())
    replicas = [ready("r1", M, "http://e1:1"), ready("r2", M, "http://e2:1")]
    # No admission queue (max_waiting 0): a full model answers 503 at once
    # (the queue's own tests: tests/gateway/test_admission.py).
    capped = spec(M, max_inflight=1).model_copy(update={"queue": QueuePolicy(max_waiting=0)})
    async with gateway(tmp_path / "s.db", replicas, [capped], engine) as gw:
        _, key = gw.key()

        async def post() -> httpx.Response:
            return await gw.http.post("/v1/chat/completions", json=chat(), headers=auth(key))

        held = [asyncio.create_task(post()) for _ in range(2)]
        async with asyncio.timeout(5):
            while len(engine.seen) < 2:
                await asyncio.sleep(0.01)
        assert {r.url.host for r in engine.seen} == {"e1", "e2"}  # one each
        full = await post()
        assert full.status_code == 503 and full.json()["error"]["code"] == "replicas_saturated"
        assert full.headers["retry-after"] == "1"
        assert engine.hold is not None
        engine.hold.set()
        assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200]
        assert (await post()).status_code == 200


async def test_a_client_gone_before_the_first_byte_releases_its_replica(gw: Gateway) -> None:
    key_id, key = gw.key()
    body = json.dumps(chat(max_tokens=3, stream=True)).encode()
    sent: list[str] = []

    async def receive() -> dict[str, object]:
        if not sent:  # the request body first, then the client is gone
            sent.append("body")
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(str(message["type"]))
        # A client that never takes the response: the disconnect cancels the
        # answer here, before the stream's first byte is even asked for.
        await asyncio.Event().wait()

    await gw.app(post_scope("/v1/chat/completions", key), receive, send)  # type: ignore[arg-type]
    deps = gw.app.state.deps
    assert all(r.inflight == 0 for rs in deps.table.routes.values() for r in rs)
    await deps.accountant.flush()
    assert [r.requests for r in usage.query(gw.store, key_id=key_id)] == [1]


async def test_a_client_gone_during_a_non_streamed_request_cancels_it(tmp_path: Path) -> None:
    engine = MockEngine(hold=asyncio.Event())  # the engine "generates" until told
    # vLLM aborts on the closed connection (llama.cpp generates on, and is
    # awaited: tests/gateway/test_billing_disconnect.py).
    vllm = spec(M).model_copy(update={"engine": EngineKind.VLLM})
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [vllm], engine) as gw:
        key_id, key = gw.key()
        body = json.dumps(chat(max_tokens=3)).encode()
        gone = asyncio.Event()
        read: list[bytes] = []

        async def receive() -> dict[str, object]:
            if not read:
                read.append(body)
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            pass

        answer = asyncio.create_task(gw.app(post_scope("/v1/chat/completions", key), receive, send))  # type: ignore[arg-type]
        async with asyncio.timeout(5):
            while not engine.seen:
                await asyncio.sleep(0.01)
        gone.set()  # the client leaves while the engine is still at it
        async with asyncio.timeout(5):
            await answer  # the router let go of the engine without its answer
        deps = gw.app.state.deps
        assert all(r.inflight == 0 for rs in deps.table.routes.values() for r in rs)
        await deps.accountant.flush()
        [row] = usage.query(gw.store, key_id=key_id)
        # Billed the reservation: what the engine may have generated is unknown.
        assert (row.requests, row.errors, row.completion_tokens) == (1, 1, 3)
        assert engine.hold is not None
        engine.hold.set()


class _StalledTemporal(FakeSource):
    """Answers once, then never again (a Temporal that hangs)."""

    def __init__(self, replicas: list[ReplicaMemo]) -> None:
        super().__init__(replicas)
        self.calls = 0

    async def replicas(self) -> list[ReplicaMemo]:
        self.calls += 1
        if self.calls > 1:
            await asyncio.Event().wait()
        return self.items


async def test_requests_never_wait_on_temporal(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    store.put_model(spec(M))
    _, key = create_key(store, "k", KeyPolicy())
    engine = MockEngine()
    source = _StalledTemporal([ready("r1", M, "http://e1:1")])
    app = create_app(
        store,
        source,
        refresh_interval_s=0.01,
        http=MockUpstream(engine),
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            async with asyncio.timeout(5):
                while source.calls < 2:  # the refresh is now stuck in Temporal
                    await asyncio.sleep(0.01)
                for _ in range(3):
                    r = await http.post("/v1/chat/completions", json=chat(), headers=auth(key))
                    assert r.status_code == 200
    store.close()
