"""Cache-aware routing wired into the router (issue 26), in front of a scripted
engine that keeps a prompt cache per replica and reports
``usage.prompt_tokens_details.cached_tokens`` as llama.cpp does: where a
follow-up turn goes, what the span and the metrics say, the Affinity told once
per request, replicas forgotten when they leave the table, the catalog's
policy honoured, the sticky keys (session header, ``user``, a Responses chain).

The scoring rule itself is tested without a router (tests/gateway/
test_affinity*.py); real llama.cpp replicas behind two routers:
tests/e2e/test_prefix_routing.py.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw.engine_keys import exec_token
from llmgw.types import ModelSpec, QueuePolicy, RoutingPolicy, RoutingPolicyKind
from router.affinity.affinity import Affinity
from router.affinity.chunks import PromptKey
from router.affinity.policy import Choice
from router.control_link.routing import RoutingTable
from tests.gateway_util import ADMIN_KEY, Gateway, MockEngine, auth, gateway, ready, spec, sse

M = "m-prefix"
# Long enough that a conversation's history passes min_match_tokens (64).
SYSTEM = "You are a careful assistant. " * 40
TOKENS_PER_MESSAGE = 100  # the engine's count: 100 tokens a message


@dataclass
class CachingEngine(MockEngine):
    """A chat engine per host (replica) with a prompt cache: a prompt's cached
    tokens are those of its longest leading run of messages the same host
    served before. ``holds`` parks requests to one host until set."""

    served: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)
    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    # llama.cpp slot saves and restores asked of it: (host, slot, action).
    slot_actions: list[tuple[str, int, str]] = field(default_factory=list)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path.startswith("/slots/"):
            slot = int(request.url.path.rsplit("/", 1)[1])
            self.slot_actions.append((host, slot, request.url.params["action"]))
            return httpx.Response(200, json={"id_slot": slot})
        self.seen.append(request)
        hold = self.holds.get(host)
        if hold is not None:
            await hold.wait()
        data = json.loads(request.content)
        # A completions prompt counts as one message.
        messages = data["messages"] if "messages" in data else [data["prompt"]]
        texts = tuple(json.dumps(m, sort_keys=True) for m in messages)
        cache = self.served.setdefault(host, set())
        hit = max((k for k in range(len(texts) + 1) if texts[:k] in cache), default=0)
        cache.update(texts[:k] for k in range(1, len(texts) + 1))
        prompt = TOKENS_PER_MESSAGE * len(texts)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 2,
            "total_tokens": prompt + 2,
            "prompt_tokens_details": {"cached_tokens": TOKENS_PER_MESSAGE * hit},
        }
        message = {"role": "assistant", "content": f"answer {len(texts)}"}
        if not data.get("stream"):
            return httpx.Response(
                200, json={"object": "chat.completion", "model": data["model"],
                           "choices": [{"index": 0, "message": message,
                                        "finish_reason": "stop"}], "usage": usage},
            )  # fmt: skip
        chunks: list[dict[str, Any]] = [
            {"choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
        if (data.get("stream_options") or {}).get("include_usage"):
            chunks.append({"choices": [], "usage": usage})
        return httpx.Response(
            200, content=sse(*chunks), headers={"content-type": "text/event-stream"}
        )


@dataclass
class Served:
    model: str
    replica_id: str
    key: PromptKey | None
    choice: Choice
    prompt_tokens: int | None
    cached_tokens: int | None


class RecordingAffinity(Affinity):
    """The router's Affinity, recording what it is asked and told."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[PromptKey | None] = []
        self.served_calls: list[Served] = []
        self.forgotten: list[str] = []

    def choose(
        self, spec: ModelSpec | None, candidates: list[Any], key: PromptKey | None
    ) -> Choice:
        self.keys.append(key)
        return super().choose(spec, candidates, key)

    def served(
        self,
        model: str,
        replica_id: str,
        key: PromptKey | None,
        choice: Choice,
        prompt_tokens: int | None,
        cached_tokens: int | None,
    ) -> None:
        self.served_calls.append(
            Served(model, replica_id, key, choice, prompt_tokens, cached_tokens)
        )
        super().served(model, replica_id, key, choice, prompt_tokens, cached_tokens)

    def forget(self, replica_id: str) -> None:
        self.forgotten.append(replica_id)
        super().forget(replica_id)


REPLICAS = [ready("r1", M, "http://e1:1"), ready("r2", M, "http://e2:1"),
            ready("r3", M, "http://e3:1")]  # fmt: skip


def model(policy: RoutingPolicyKind = RoutingPolicyKind.PREFIX, **profile: Any) -> ModelSpec:
    return spec(M, **profile).model_copy(update={"routing": RoutingPolicy(policy=policy)})


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    yield InMemorySpanExporter()


@dataclass
class Routed:
    gw: Gateway
    affinity: RecordingAffinity
    engine: CachingEngine

    @property
    def table(self) -> RoutingTable:
        table: RoutingTable = self.gw.app.state.deps.table
        return table


@asynccontextmanager
async def routed(
    tmp_path: Path,
    exporter: InMemorySpanExporter | None = None,
    spec_: ModelSpec | None = None,
    replicas: list[Any] | None = None,
) -> AsyncIterator[Routed]:
    affinity, engine = RecordingAffinity(), CachingEngine()
    extra: dict[str, Any] = {}
    if exporter is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        extra["tracer"] = provider.get_tracer("test")
    async with gateway(
        tmp_path / "s.db", list(replicas or REPLICAS), [spec_ or model()], engine,
        affinity=affinity, **extra,
    ) as gw:  # fmt: skip
        yield Routed(gw, affinity, engine)


def turns(conversation: str, n: int) -> list[dict[str, str]]:
    """A conversation's messages through its ``n``-th user turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(n):
        if i:
            messages.append({"role": "assistant", "content": f"answer {2 * i}"})
        messages.append({"role": "user", "content": f"{conversation}: question {i} " * 20})
    return messages


async def ask(
    gw: Gateway,
    key: str,
    messages: list[dict[str, str]],
    stream: bool = False,
    *,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> httpx.Response:
    body = {"model": M, "messages": messages, "max_tokens": 2, "stream": stream, **(extra or {})}
    r = await gw.http.post("/v1/chat/completions", json=body, headers=auth(key) | (headers or {}))
    assert r.status_code == 200, r.text
    return r


async def metrics(gw: Gateway) -> str:
    return (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_follow_up_turn_goes_where_its_history_is_cached(
    tmp_path: Path, exporter: InMemorySpanExporter, stream: bool
) -> None:
    async with routed(tmp_path, exporter) as r:
        _, key = r.gw.key()
        first = (await ask(r.gw, key, turns("c1", 1), stream)).headers["x-llmgw-replica"]
        for n in (2, 3, 4):
            again = await ask(r.gw, key, turns("c1", n), stream)
            assert again.headers["x-llmgw-replica"] == first
        spans = exporter.get_finished_spans()
        attrs: list[dict[str, Any]] = [dict(s.attributes or {}) for s in spans]
        # Nothing held anywhere: the rendezvous choice; then the cached prefix.
        assert attrs[0]["llmgw.route.reason"] == "rendezvous"
        assert attrs[0]["llmgw.route.predicted_cached_tokens"] == 0
        assert attrs[0]["llmgw.route.cached_tokens"] == 0
        for a in attrs[1:]:
            assert a["llmgw.route.reason"] == "prefix" and a["llmgw.replica"] == first
            assert a["llmgw.route.predicted_cached_tokens"] > 0
            assert a["llmgw.route.cached_tokens"] > 0  # the engine's own count
        # The engine reported what it took from its cache (each turn: the
        # previous prompt, whole); the router counted it.
        cached = sum(s.cached_tokens or 0 for s in r.affinity.served_calls)
        assert cached == TOKENS_PER_MESSAGE * (2 + 4 + 6)
        text = await metrics(r.gw)
        assert f'llmgw_router_route_choices_total{{model="{M}",reason="prefix"}} 3.0' in text
        assert f'llmgw_router_route_choices_total{{model="{M}",reason="rendezvous"}} 1.0' in text
        labels = f'{{model="{M}",replica="{first}"}}'
        prompt = TOKENS_PER_MESSAGE * (2 + 4 + 6 + 8)
        assert f"llmgw_router_prompt_tokens_total{labels} {float(prompt)}" in text
        assert f"llmgw_router_cached_tokens_total{labels} {float(cached)}" in text
        predicted = sum(a["llmgw.route.predicted_cached_tokens"] for a in attrs)
        line = f"llmgw_router_prefix_predicted_tokens_total{labels} {float(predicted)}"
        assert line in text


@pytest.mark.parametrize("stream", [False, True])
async def test_the_affinity_is_told_once_per_request_what_the_engine_served(
    tmp_path: Path, stream: bool
) -> None:
    async with routed(tmp_path) as r:
        _, key = r.gw.key()
        replica = (await ask(r.gw, key, turns("c2", 1), stream)).headers["x-llmgw-replica"]
        assert len(r.affinity.served_calls) == 1
        [told] = r.affinity.served_calls
        assert (told.model, told.replica_id) == (M, replica)
        assert (told.prompt_tokens, told.cached_tokens) == (2 * TOKENS_PER_MESSAGE, 0)
        assert told.key is r.affinity.keys[0] and told.key is not None
        await ask(r.gw, key, turns("c2", 2), stream)
        assert len(r.affinity.served_calls) == 2
        assert r.affinity.served_calls[1].cached_tokens == 2 * TOKENS_PER_MESSAGE
        assert r.affinity.held_tokens(M, replica) > 0


async def test_a_replica_leaving_the_table_or_moving_is_forgotten(tmp_path: Path) -> None:
    async with routed(tmp_path) as r:
        _, key = r.gw.key()
        at = (await ask(r.gw, key, turns("c3", 1))).headers["x-llmgw-replica"]
        assert r.affinity.held_tokens(M, at) > 0
        assert r.gw.source is not None
        # A new endpoint is a new engine: its cache holds nothing we knew.
        r.gw.source.items = [
            ready(m.replica_id, M, "http://moved:1") if m.replica_id == at else m for m in REPLICAS
        ]
        await until(lambda: at in r.affinity.forgotten)
        assert r.affinity.forgotten == [at]  # the others stayed where they were
        assert r.affinity.held_tokens(M, at) == 0
        at = (await ask(r.gw, key, turns("c3", 2))).headers["x-llmgw-replica"]
        assert r.affinity.held_tokens(M, at) > 0
        # Drained (or stopped, failed, scaled to zero): out of the table.
        before = r.affinity.forgotten.count(at)
        r.gw.source.items = [m for m in REPLICAS if m.replica_id != at]
        await until(lambda: r.affinity.forgotten.count(at) == before + 1)
        assert r.affinity.held_tokens(M, at) == 0
        assert at not in {x.replica_id for x in r.table.routes[M]}


async def test_least_loaded_in_the_catalog_keeps_todays_rotation(tmp_path: Path) -> None:
    async with routed(tmp_path, spec_=model(RoutingPolicyKind.LEAST_LOADED)) as r:
        _, key = r.gw.key()
        where = [
            (await ask(r.gw, key, turns("c4", n))).headers["x-llmgw-replica"] for n in (1, 2, 3)
        ]
        assert sorted(where) == ["r1", "r2", "r3"]  # equal loads take turns, as before
        assert r.affinity.keys == [None, None, None]  # no prompt key is even made
        text = await metrics(r.gw)
        assert f'llmgw_router_route_choices_total{{model="{M}",reason="least_loaded"}} 3.0' in text


async def test_a_full_replica_is_passed_over_for_the_next_best(tmp_path: Path) -> None:
    capped = model(max_inflight=1).model_copy(update={"queue": QueuePolicy(max_waiting=0)})
    async with routed(tmp_path, spec_=capped) as r:
        _, key = r.gw.key()
        at = (await ask(r.gw, key, turns("c5", 1))).headers["x-llmgw-replica"]
        r.engine.holds[at.replace("r", "e")] = hold = asyncio.Event()
        # Fill the replica holding c5 (at its max_inflight) with c5's next turn.
        held = asyncio.create_task(ask(r.gw, key, turns("c5", 2)))
        await until(lambda: any(x.inflight for x in r.table.routes[M] if x.replica_id == at))
        # The turn after goes to another replica at once: not refused, not queued.
        follow = await ask(r.gw, key, turns("c5", 3))
        assert follow.headers["x-llmgw-replica"] != at
        hold.set()
        assert (await held).headers["x-llmgw-replica"] == at


@pytest.mark.parametrize(
    ("headers", "extra", "sticky"),
    [
        (
            {"X-Llmgw-Session": "s-1"},
            {"user": "u-1", "prompt_cache_key": "k-1"},
            "cache:{key_id}:k-1",
        ),
        ({"X-Llmgw-Session": "s-1"}, {"user": "u-1"}, "session:{key_id}:s-1"),
        ({}, {"user": "u-1"}, "user:{key_id}:u-1"),
        ({}, {}, None),
    ],
)
async def test_sticky_keys_from_the_session_header_or_user(
    tmp_path: Path, headers: dict[str, str], extra: dict[str, str], sticky: str | None
) -> None:
    async with routed(tmp_path) as r:
        key_id, key = r.gw.key()
        await ask(r.gw, key, turns("c7", 1), headers=headers, extra=extra)
        [made] = r.affinity.keys
        assert made is not None
        assert made.sticky == (sticky.format(key_id=key_id) if sticky else None)


async def test_a_streams_prompt_key_is_the_requests_own(tmp_path: Path) -> None:
    """A stream whose usage the router asks for has its body rewritten, and
    its prompt key read from that same parse: the key (sticky key included)
    is the one the request gets unstreamed or asking for usage itself. A
    body orjson refuses (NaN) gets none, streamed or not."""
    async with routed(tmp_path) as r:
        _, key = r.gw.key()
        messages, user = turns("c9", 2), {"user": "u-9"}
        usage = user | {"stream_options": {"include_usage": True}}
        for stream, extra in ((False, user), (True, user), (True, usage)):
            await ask(r.gw, key, messages, stream, extra=extra)
        first = r.affinity.keys[0]
        assert first is not None and first.sticky is not None
        assert r.affinity.keys == [first] * 3
        for stream in (False, True):
            body = {"model": M, "messages": messages, "max_tokens": 2, "stream": stream}
            raw = json.dumps(body | {"odd": float("nan")}).encode()  # NaN: not JSON to orjson
            headers = auth(key) | {"content-type": "application/json"}
            answer = await r.gw.http.post("/v1/chat/completions", content=raw, headers=headers)
            assert answer.status_code == 200, answer.text
        assert r.affinity.keys[3:] == [None, None]


async def test_every_turn_of_a_responses_chain_shares_its_first_responses_id(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path) as r:
        key_id, key = r.gw.key()
        previous: str | None = None
        ids: list[str] = []
        for turn in range(3):
            body: dict[str, Any] = {"model": M, "input": f"turn {turn} " + SYSTEM}
            if previous is not None:
                body["previous_response_id"] = previous
            resp = await r.gw.http.post("/v1/responses", json=body, headers=auth(key))
            assert resp.status_code == 200, resp.text
            previous = resp.json()["id"]
            ids.append(previous)
            async with asyncio.timeout(10):  # stored behind the answer
                url = f"/v1/responses/{previous}"
                while (await r.gw.http.get(url, headers=auth(key))).status_code != 200:
                    await asyncio.sleep(0.01)
        stickies = [k.sticky if k else None for k in r.affinity.keys]
        assert stickies == [f"session:{key_id}:resp:{ids[0]}"] * 3
        # A client's own session header does not split the chain.
        body = {"model": M, "input": "again", "previous_response_id": ids[2]}
        headers = auth(key) | {"X-Llmgw-Session": "mine"}
        again = await r.gw.http.post("/v1/responses", json=body, headers=headers)
        assert again.status_code == 200, again.text
        last = r.affinity.keys[-1]
        assert last is not None and last.sticky == f"session:{key_id}:resp:{ids[0]}"
        # Every turn went where the conversation is cached.
        assert len({s.replica_id for s in r.affinity.served_calls}) == 1
        # OpenAI's prompt_cache_key is the client's own word on what shares a prefix.
        body = {"model": M, "input": "keyed " + SYSTEM, "prompt_cache_key": "k-9"}
        keyed = await r.gw.http.post("/v1/responses", json=body, headers=auth(key))
        assert keyed.status_code == 200, keyed.text
        last = r.affinity.keys[-1]
        assert last is not None and last.sticky == f"cache:{key_id}:k-9"


async def until(cond: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


async def test_a_prompt_too_short_to_cache_goes_where_the_load_says(tmp_path: Path) -> None:
    async with routed(tmp_path) as r:
        _, key = r.gw.key()
        short = [{"role": "user", "content": "hi"}]  # far below min_match_tokens
        where = [(await ask(r.gw, key, short)).headers["x-llmgw-replica"] for _ in range(3)]
        assert sorted(where) == ["r1", "r2", "r3"]  # taking turns, as before
        text = await metrics(r.gw)
        assert f'llmgw_router_route_choices_total{{model="{M}",reason="least_loaded"}} 3.0' in text
        # Each was still recorded where it was served.
        assert len(r.affinity.served_calls) == 3
        assert all(s.key is not None for s in r.affinity.served_calls)


async def test_a_background_turn_run_by_the_executor_shares_its_chains_session(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path) as r:
        key_id, key = r.gw.key()
        first = await r.gw.http.post(
            "/v1/responses", json={"model": M, "input": "turn one " + SYSTEM}, headers=auth(key)
        )
        assert first.status_code == 200, first.text
        root = first.json()["id"]
        async with asyncio.timeout(10):  # stored behind the answer
            while (
                await r.gw.http.get(f"/v1/responses/{root}", headers=auth(key))
            ).status_code != 200:
                await asyncio.sleep(0.01)
        body = {"model": M, "input": "turn two", "previous_response_id": root, "background": True}
        queued = await r.gw.http.post("/v1/responses", json=body, headers=auth(key))
        assert queued.status_code == 200, queued.text
        # The executor runs it as the key (its token; the client's session header, if it
        # had sent one, is not the executor's to carry).
        token = exec_token(r.gw.store.engine_key_secret(), key_id)
        headers = {"Authorization": f"Bearer {token}", "X-Llmgw-Key-Id": str(key_id)}
        run = await r.gw.http.post(
            f"/internal/responses/{queued.json()['id']}/run", headers=headers
        )
        assert run.status_code == 200, run.text
        assert "response.completed" in run.text
        stickies = [k.sticky if k else None for k in r.affinity.keys]
        assert stickies == [f"session:{key_id}:resp:{root}"] * 2
        assert len({s.replica_id for s in r.affinity.served_calls}) == 1


async def test_a_request_ending_after_its_replica_left_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path) as r:
        _, key = r.gw.key()
        at = (await ask(r.gw, key, turns("c8", 1))).headers["x-llmgw-replica"]
        r.engine.holds[at.replace("r", "e")] = asyncio.Event()
        running = asyncio.create_task(ask(r.gw, key, turns("c8", 2)))
        await until(lambda: any(x.inflight for x in r.table.routes[M] if x.replica_id == at))
        assert r.gw.source is not None
        r.gw.source.items = [m for m in REPLICAS if m.replica_id != at]  # drained meanwhile
        await until(lambda: at in r.affinity.forgotten)
        r.engine.holds[at.replace("r", "e")].set()
        assert (await running).headers["x-llmgw-replica"] == at  # answered all the same
        assert r.affinity.held_tokens(M, at) == 0
        assert [s.replica_id for s in r.affinity.served_calls] == [at]  # the first turn only


@pytest.mark.parametrize(
    ("policy", "reason"),
    [(RoutingPolicyKind.SESSION, "session"), (RoutingPolicyKind.ROUND_ROBIN, "round_robin")],
)
async def test_the_catalogs_other_policies_apply_to_short_prompts_too(
    tmp_path: Path, policy: RoutingPolicyKind, reason: str
) -> None:
    async with routed(tmp_path, spec_=model(policy)) as r:
        _, key = r.gw.key()
        short = [{"role": "user", "content": "hi"}]
        where = {
            (await ask(r.gw, key, short, headers={"X-Llmgw-Session": "s"})).headers[
                "x-llmgw-replica"
            ]
            for _ in range(3)
        }
        assert len(where) == (1 if policy is RoutingPolicyKind.SESSION else 3)
        text = await metrics(r.gw)
        assert f'llmgw_router_route_choices_total{{model="{M}",reason="{reason}"}} 3.0' in text
