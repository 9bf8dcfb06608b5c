"""Cache scopes (issue 34, router/affinity/scope.py) without engines: the
catalog field, chunk chains that never meet across scopes, routing that
does not depend on what another scope sent, the engine salt, and what a
caller is told of a shared engine cache. Through the router, in front of a
scripted engine: the salt sent to vLLM, a client's salt refused, cached
tokens and timings hidden of llama.cpp (streamed and not), and no replica
named unless the router is set to. Real llama.cpp: test_cache_isolation_llama.py.
"""

import json
import random
import string
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from llmgw.catalog import parse_catalog
from llmgw.errors import ConfigError
from llmgw.types import CacheScope, EngineKind, ModelSpec, RoutingPolicy
from router.affinity.affinity import Affinity
from router.affinity.chunks import PromptKey, prompt_key
from router.affinity.scope import SHARED, cache_salt, hides_cached, salts, scope_of
from router.control_link.routing import Route
from router.forwarding.cache_report import hidden
from tests.gateway_util import ADMIN_KEY, MockEngine, auth, gateway, ready, sse

IDS = ["r0", "r1", "r2", "r3"]
SYSTEM = {"role": "system", "content": "You read the document and answer. " * 20}
A, B = scope_of(None, 1), scope_of(None, 2)


def _spec(
    scope: CacheScope = CacheScope.KEY, engine: EngineKind = EngineKind.LLAMA_CPP
) -> ModelSpec:
    return ModelSpec(
        name="m", engine=engine, source="/w", context_length=100_000, cache_scope=scope,
        routing=RoutingPolicy(),
    )  # fmt: skip


def _key(doc: str, scope: str, question: str = "When?") -> PromptKey:
    body = {"messages": [SYSTEM, {"role": "user", "content": f"{doc}\n{question}"}]}
    key = prompt_key(body, 256, None, scope)
    assert key is not None
    return key


def _doc(rng: random.Random) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(200))


def _routes() -> list[Route]:
    return [Route(r, "m", f"http://{r}:1") for r in IDS]


def _serve(affinity: Affinity, spec: ModelSpec, key: PromptKey) -> str:
    choice = affinity.choose(spec, _routes(), key)
    replica = choice.order[0].replica_id
    affinity.served("m", replica, key, choice, key.prompt_tokens, None)
    return replica


def test_cache_scope_defaults_to_key_and_team_is_refused_until_keys_have_teams() -> None:
    assert ModelSpec(name="m", source="/w").cache_scope is CacheScope.KEY
    with pytest.raises(ValidationError, match="API keys have no teams"):
        ModelSpec(name="m", source="/w", cache_scope="team")
    with pytest.raises(ConfigError, match=r"models\[0\]\.cache_scope: .*no teams"):
        parse_catalog("models:\n  - {name: m, source: /w, cache_scope: team}\n")
    (entry,) = parse_catalog("models:\n  - {name: m, source: /w, cache_scope: shared}\n")
    assert entry.spec().cache_scope is CacheScope.SHARED
    # Not how an engine runs: changing it restarts no replica.
    assert entry.spec().digest() == ModelSpec(name="m", source="/w").digest()


def test_scope_ids() -> None:
    assert scope_of(_spec(CacheScope.SHARED), 7) == SHARED
    assert scope_of(_spec(), 7) == "key:7" == scope_of(None, 7)


def test_two_scopes_chains_of_one_prompt_share_no_digest() -> None:
    doc = _doc(random.Random(1))
    a, b, shared = _key(doc, A), _key(doc, B), _key(doc, SHARED)
    assert a == _key(doc, A)  # a scope's own chain is stable
    digests = [{c.digest for c in k.chunks} for k in (a, b, shared)]
    assert not digests[0] & digests[1] and not digests[0] & digests[2]
    assert len({a.lead, b.lead, shared.lead}) == 3
    # The shared scope's chain is the one every router computed before scopes.
    assert shared == prompt_key(
        {"messages": [SYSTEM, {"role": "user", "content": f"{doc}\nWhen?"}]}, 256
    )
    # Sticky keys likewise (they are also namespaced by the key).
    assert _sticky("s", A).lead != _sticky("s", B).lead


def _sticky(sticky: str, scope: str) -> PromptKey:
    key = prompt_key({"messages": [{"role": "user", "content": "hi"}]}, 256, sticky, scope)
    assert key is not None
    return key


def test_nothing_a_scope_sent_is_credited_to_another() -> None:
    affinity, spec = Affinity(), _spec()
    doc = _doc(random.Random(2))
    at = _serve(affinity, spec, _key(doc, A))
    assert affinity.held_tokens("m", at) > 0
    choice = affinity.choose(spec, _routes(), _key(doc, B))
    assert choice.predicted == 0 and choice.reason.value != "prefix"
    # A's own follow-up is credited as before.
    again = affinity.choose(spec, _routes(), _key(doc, A, "And the price?"))
    assert again.order[0].replica_id == at and again.reason.value == "prefix"


@pytest.mark.parametrize("scope", [CacheScope.KEY, CacheScope.SHARED])
def test_bs_routing_follows_as_document_only_under_shared(scope: CacheScope) -> None:
    """The two-key probe, as routing: B asks about document D where A sent D
    (a right guess) or sent D' (a wrong one), everything else alike, each
    world with its router secret. Under key scope nothing A's prompt holds
    is credited to B: B's choice depends on A only through where A's
    conversation lives (the balance counts), which B cannot compute without
    the secret, and is the same in both worlds whenever that is. Shared, B
    follows A's document to its replica."""
    spec, rng = _spec(scope), random.Random(3)
    landed = {"right": 0, "wrong": 0}  # B's guess went to A's replica
    for i in range(64):
        doc, other = _doc(rng), _doc(rng)
        secret = f"router secret {i}"

        def chain(key_id: int, secret: str = secret) -> str:
            scope_id = scope_of(spec, key_id)
            return cache_salt(secret, scope_id) if scope_id else SHARED  # Proxy.chain_scope

        worlds = []
        for sent in (doc, other):
            affinity = Affinity(clock=lambda: 0.0)
            a_at = _serve(affinity, spec, _key(sent, chain(1)))
            choice = affinity.choose(spec, _routes(), _key(doc, chain(2)))
            worlds.append((choice.order[0].replica_id, choice.reason, choice.predicted, a_at))
        right, wrong = worlds
        landed["right"] += right[0] == right[3]
        landed["wrong"] += wrong[0] == wrong[3]
        if scope is CacheScope.KEY:
            assert right[2] == wrong[2] == 0
            if right[3] == wrong[3]:  # A's conversation placed alike: B's choice alike
                assert right[:3] == wrong[:3]
        else:
            assert right[0] == right[3] and right[2] > 0 and wrong[2] == 0
    if scope is CacheScope.KEY:
        assert landed["right"] == landed["wrong"], landed  # (balance keeps B off A's replica)
    else:
        assert landed["right"] == 64


def test_the_salt_is_the_routers_own_and_one_vllm_accepts() -> None:
    salt = cache_salt("secret", A)
    assert salt == cache_salt("secret", A) != cache_salt("secret", B) != cache_salt("other", A)
    # vLLM's validate_cache_salt: non-empty, at most 128, none of @ / \ NUL.
    assert 0 < len(salt) <= 128 and not set(salt) & set("@/\\\0")
    with pytest.raises(ValueError, match="empty"):
        cache_salt("", A)


def test_which_engines_salt_and_which_hide() -> None:
    for engine in (EngineKind.VLLM, EngineKind.SGLANG):
        assert salts(_spec(engine=engine), A) and not hides_cached(_spec(engine=engine), A)
        assert not salts(_spec(CacheScope.SHARED, engine), SHARED)
    assert not salts(_spec(), A) and hides_cached(_spec(), A) and hides_cached(None, A)
    assert not hides_cached(_spec(CacheScope.SHARED), SHARED)


def test_hidden_zeroes_cached_tokens_and_drops_timings() -> None:
    usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}
    answer = {"id": "x", "usage": usage, "timings": {"cache_n": 8, "prompt_n": 1}}
    out = json.loads(hidden(json.dumps(answer).encode()))
    assert out == {
        "id": "x",
        "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    assert hidden(b"not json") == b"not json"
    plain = b'{"usage":{"prompt_tokens":9}}'
    assert hidden(plain) == plain


# Through the router, in front of a scripted engine.

USAGE = {"prompt_tokens": 500, "completion_tokens": 1, "total_tokens": 501,
         "prompt_tokens_details": {"cached_tokens": 480}}  # fmt: skip
TIMINGS = {"cache_n": 480, "prompt_n": 20, "prompt_ms": 3.5}


class CacheReportingEngine(MockEngine):
    """Answers as llama.cpp does: cached tokens and timings, streamed or not
    (with ``timings_per_token``, timings in every chunk)."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        data = json.loads(request.content)
        if not data.get("stream"):
            return httpx.Response(200, json={
                "object": "chat.completion", "model": data["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"},
                             "finish_reason": "stop"}],
                "usage": USAGE, "timings": TIMINGS,
            })  # fmt: skip
        chunks: list[dict[str, Any]] = [
            {"choices": [{"index": 0, "delta": {"content": "a"}}], "timings": TIMINGS},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"choices": [], "usage": USAGE, "timings": TIMINGS},
        ]
        return httpx.Response(
            200, content=sse(*chunks), headers={"content-type": "text/event-stream"}
        )


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def _metric(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics", headers=auth(ADMIN_KEY))).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("scope", [CacheScope.KEY, CacheScope.SHARED])
async def test_a_shared_engine_cache_is_not_reported_to_callers(
    tmp_path: Path, scope: CacheScope
) -> None:
    engine = CacheReportingEngine()
    async with gateway(
        tmp_path / "s.db", [ready("r1", "m", "http://e1:1")], [_spec(scope)], engine
    ) as gw:
        _, key = gw.key()
        whole = await gw.http.post("/v1/chat/completions", json=BODY, headers=auth(key))
        streamed = await gw.http.post(
            "/v1/chat/completions", headers=auth(key),
            json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
        )  # fmt: skip
        events = [
            json.loads(line[6:])
            for line in streamed.text.split("\n\n")
            if line.startswith("data: {")
        ]
        # The engine's own count still reaches the router's metrics (admins).
        assert await _metric(gw.http, "llmgw_router_cached_tokens_total") == 2 * 480
    usages = [whole.json()["usage"], *(e["usage"] for e in events if e.get("usage"))]
    assert len(usages) == 2
    if scope is CacheScope.KEY:
        assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in usages)
        assert all(u["prompt_tokens"] == 500 for u in usages)
        assert "timings" not in whole.json() and not any("timings" in e for e in events)
        assert (
            "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
            == "a"
        )
    else:
        assert all(u["prompt_tokens_details"]["cached_tokens"] == 480 for u in usages)
        assert whole.json()["timings"] == TIMINGS and sum("timings" in e for e in events) == 2


async def test_vllm_gets_each_keys_own_salt_and_never_a_clients(tmp_path: Path) -> None:
    models = [
        _spec(engine=EngineKind.VLLM),
        _spec(CacheScope.SHARED, EngineKind.VLLM).model_copy(update={"name": "s"}),
    ]
    replicas = [ready("r1", "m", "http://e1:1"), ready("r2", "s", "http://e2:1")]
    async with gateway(tmp_path / "s.db", replicas, models) as gw:
        secret = gw.store.engine_key_secret()
        (id_a, a), (id_b, b) = gw.key(), gw.key()
        for key, key_id in ((a, id_a), (b, id_b), (a, id_a)):
            r = await gw.http.post("/v1/chat/completions", json=BODY, headers=auth(key))
            assert r.status_code == 200
            assert gw.engine.body()["cache_salt"] == cache_salt(secret, f"key:{key_id}")
        assert gw.engine.body(0)["cache_salt"] != gw.engine.body(1)["cache_salt"]
        # Shared: no salt, as before.
        r = await gw.http.post("/v1/chat/completions", json={**BODY, "model": "s"}, headers=auth(a))
        assert r.status_code == 200 and "cache_salt" not in gw.engine.body()
        sent = len(gw.engine.seen)
        for model in ("m", "s"):
            r = await gw.http.post(
                "/v1/chat/completions",
                json={**BODY, "model": model, "cache_salt": "x"},
                headers=auth(a),
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert len(gw.engine.seen) == sent


async def test_no_replica_is_named_unless_the_router_is_set_to(tmp_path: Path) -> None:
    replicas = [ready("r1", "m", "http://e1:1")]
    for expose in (False, True):
        async with gateway(
            tmp_path / f"{expose}.db", replicas, [_spec()], expose_replica_header=expose
        ) as gw:
            _, key = gw.key()
            whole = await gw.http.post("/v1/chat/completions", json=BODY, headers=auth(key))
            streamed = await gw.http.post(
                "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth(key)
            )
            assert whole.status_code == streamed.status_code == 200
            named = [r.headers.get("x-llmgw-replica") for r in (whole, streamed)]
            assert named == (["r1", "r1"] if expose else [None, None])
