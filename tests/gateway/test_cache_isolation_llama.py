"""Issue 34's two-key probe, through the router, against real llama.cpp
servers and the official openai client.

Key A sends a system prompt and a confidential document; key B sends the
same two messages (a right guess) or another document (a wrong one). Under
``cache_scope: key`` (the default) B learns nothing: the same cached_tokens
(0) and no engine timings for both guesses, though the engine did serve the
right guess from A's cache (the router's own metrics say so), and the
router's routing of B's guess is the same whether it is right or wrong.
Under ``cache_scope: shared`` the probe works as it did: B's right guess is
routed to A's replica and reported cached.

The index's own non-interference (no prefix of one scope credited to
another) is tested without engines: tests/gateway/test_cache_scope.py.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import uvicorn

from llmgw.store import Store
from llmgw.types import CacheScope, EngineProfile, ModelSpec, RoutingPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from router.affinity.affinity import Affinity
from router.affinity.chunks import PromptKey
from router.affinity.policy import Choice
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from tests.gateway_util import FakeSource, ready
from tests.harness import free_port
from tests.llama_servers import llama_servers, store_secret

if TYPE_CHECKING:
    from worker_agent.installs.llamacpp import LlamaCppInstall

M = "tiny-iso"
ADMIN = "isolation-admin"
CONTEXT = 2048
SYSTEM = "You answer questions about the document you are given, briefly. " * 6
# Long enough to pass min_match_tokens (64 estimated) on its own.
SECRET_DOC = "The merger with Northwind closes on the ninth of March at a price of 41. " * 8
OTHER_DOC = "The merger with Southwind closes on the third of April at a price of 17. " * 8


@dataclass
class Engines:
    endpoints: dict[str, str]
    store_url: str


@pytest.fixture(scope="module")
def engines(
    llama: "LlamaCppInstall", tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """Two llama.cpp servers, one slot each, keyed as the router keys them."""
    root = tmp_path_factory.mktemp("isolation")
    store_url = f"sqlite:///{root / 's.db'}"
    secret = store_secret(store_url)
    with llama_servers(llama, tiny, root, secret, M, ["r1", "r2"], CONTEXT) as endpoints:
        yield Engines(endpoints, store_url)


class RecordingAffinity(Affinity):
    """The router's Affinity, recording each choice it made."""

    def __init__(self) -> None:
        super().__init__()
        self.choices: list[Choice] = []

    def choose(
        self, spec: ModelSpec | None, candidates: list[Any], key: PromptKey | None
    ) -> Choice:
        choice = super().choose(spec, candidates, key)
        self.choices.append(choice)
        return choice


@dataclass
class Router:
    base: str
    store: Store
    affinity: RecordingAffinity
    keys: dict[str, str] = field(default_factory=dict)

    def client(self, who: str) -> openai.AsyncOpenAI:
        if who not in self.keys:
            self.keys[who] = create_key(self.store, who, KeyPolicy())[1]
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=self.keys[who], max_retries=0)


@asynccontextmanager
async def router(
    engines: Engines, scope: CacheScope, replicas: Sequence[str], expose: bool = False
) -> AsyncIterator[Router]:
    store = Store(engines.store_url)
    store.delete_model(M)
    store.put_model(
        ModelSpec(
            name=M, source="/unused.gguf", context_length=CONTEXT,
            profile=EngineProfile(max_inflight=1), cache_scope=scope,
            # As the servers run: one slot each, the engine's choice.
            routing=RoutingPolicy(slots=0),
        )
    )  # fmt: skip
    source = FakeSource([ready(r, M, engines.endpoints[r]) for r in replicas])
    affinity = RecordingAffinity()
    app = create_app(
        store, source, refresh_interval_s=0.05, usage_flush_interval_s=0.05, admin_key=ADMIN,
        affinity=affinity, expose_replica_header=expose,
    )  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as http:
            await until(lambda: server.started)
            while not (await http.get(f"{base}/healthz")).json()["routing_table_loaded"]:
                await asyncio.sleep(0.02)
        yield Router(base, store, affinity)
    finally:
        server.should_exit = True
        await task
        store.close()


async def until(cond: Callable[[], bool], timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


def messages(doc: str, question: str = "When does it close?") -> list[Any]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\n{question}"},
    ]


@dataclass
class Seen:
    """What a caller saw of one answer."""

    prompt_tokens: int
    cached_tokens: int | None
    timings: object  # llama.cpp's timings, where they came through
    replica: str | None  # x-llmgw-replica, where exposed


async def ask(client: openai.AsyncOpenAI, doc: str, stream: bool) -> Seen:
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(
            model=M, messages=messages(doc), max_tokens=2, temperature=0
        )
        resp = raw.parse()
        assert resp.usage is not None
        details = resp.usage.prompt_tokens_details
        return Seen(
            resp.usage.prompt_tokens,
            details.cached_tokens if details is not None else None,
            (resp.model_extra or {}).get("timings"),
            raw.headers.get("x-llmgw-replica"),
        )
    seen = Seen(0, None, None, None)
    async with client.chat.completions.with_streaming_response.create(
        model=M, messages=messages(doc), max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ) as response:  # fmt: skip
        seen.replica = response.headers.get("x-llmgw-replica")
        async for chunk in await response.parse():
            if chunk.usage is not None:
                seen.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                seen.cached_tokens = details.cached_tokens if details is not None else None
            seen.timings = seen.timings or (chunk.model_extra or {}).get("timings")
    return seen


async def engine_cached(r: Router) -> float:
    """The cached tokens the engines reported to the router, all replicas together."""
    async with httpx.AsyncClient() as http:
        text = (
            await http.get(f"{r.base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        ).text
    prefix = f'llmgw_router_cached_tokens_total{{model="{M}",'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


async def probe(r: Router, stream: bool) -> tuple[Seen, Seen, float]:
    """A sends the document; B guesses it (right); A sends it again (its
    slot holds it once more); B guesses another (wrong). B's two answers,
    and the cached tokens the engines reported for B's right guess. The
    documents are new to the engines (their caches outlive each test)."""
    run = uuid.uuid4().hex
    secret, other = f"{run} {SECRET_DOC}", f"{run} {OTHER_DOC}"
    async with r.client("A") as a, r.client("B") as b:
        await ask(a, secret, stream)
        before = await engine_cached(r)
        right = await ask(b, secret, stream)
        engine_right = await engine_cached(r) - before
        await ask(a, secret, stream)
        wrong = await ask(b, other, stream)
    return right, wrong, engine_right


@pytest.mark.parametrize("stream", [False, True])
async def test_under_key_scope_a_right_guess_reads_as_a_wrong_one(
    engines: Engines, stream: bool
) -> None:
    # One replica: B's guess is served where A's document is, whatever the routing.
    async with router(engines, CacheScope.KEY, ["r1"]) as r:
        right, wrong, engine_right = await probe(r, stream)
    # The engine served B's right guess from A's cache...
    assert engine_right >= right.prompt_tokens // 2, (engine_right, right)
    # ...and B saw none of it: nothing cached either time, no timings, no replica.
    assert right.cached_tokens == wrong.cached_tokens == 0, (right, wrong)
    assert right.timings is None and wrong.timings is None
    assert right.replica is None and wrong.replica is None


@pytest.mark.parametrize("stream", [False, True])
async def test_under_shared_scope_the_cache_is_reported_as_before(
    engines: Engines, stream: bool
) -> None:
    async with router(engines, CacheScope.SHARED, ["r1"]) as r:
        right, wrong, engine_right = await probe(r, stream)
    assert right.cached_tokens == engine_right >= right.prompt_tokens // 2, (right, engine_right)
    assert wrong.cached_tokens is not None and wrong.cached_tokens < right.cached_tokens
    assert right.timings is not None


async def test_under_key_scope_b_is_routed_alike_for_a_right_and_a_wrong_guess(
    engines: Engines,
) -> None:
    async with router(engines, CacheScope.KEY, ["r1", "r2"]) as r:
        run = uuid.uuid4().hex
        # B guesses right; C (as B would, had it not asked before) wrong.
        async with r.client("A") as a, r.client("B") as b, r.client("C") as c:
            await ask(a, f"{run} {SECRET_DOC}", False)
            await ask(b, f"{run} {SECRET_DOC}", False)
            await ask(c, f"{run} {OTHER_DOC}", False)
        _, right, wrong = r.affinity.choices
    # Nothing of A's is credited to B: each guess placed as a new conversation
    # (by the rendezvous hash of B's own scope, or for balance), never for a
    # prefix held (the odds alike: tests/gateway/test_cache_scope.py).
    assert right.predicted == wrong.predicted == 0
    assert {right.reason, wrong.reason} <= {"rendezvous", "balance"}


async def test_under_shared_scope_b_is_routed_to_as_replica(engines: Engines) -> None:
    async with router(engines, CacheScope.SHARED, ["r1", "r2"], expose=True) as r:
        doc = f"{uuid.uuid4().hex} {SECRET_DOC}"
        async with r.client("A") as a, r.client("B") as b:
            at = (await ask(a, doc, False)).replica
            assert (await ask(b, doc, False)).replica == at
        _, right = r.affinity.choices
    assert right.reason == "prefix" and right.predicted > 0


# llama.cpp's own figures a client may ask for: timings per token, its whole
# native result (verbose), a stream's prompt progress.
TELLING = {"verbose": True, "return_progress": True, "timings_per_token": True}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_under_key_scope_none_of_llama_cpps_own_figures_reach_the_caller(
    engines: Engines, stream: bool, path: str
) -> None:
    doc = f"{uuid.uuid4().hex} {SECRET_DOC}"
    body: dict[str, Any] = {"model": M, "max_tokens": 2, "stream": stream, **TELLING}
    if path == "/v1/completions":
        body["prompt"] = SYSTEM + doc
    else:
        body["messages"] = messages(doc)
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with router(engines, CacheScope.KEY, ["r1"]) as r, httpx.AsyncClient() as http:
        answers = []
        for who in ("A", "B"):  # B's prompt is A's: found cached by the engine
            r.client(who)
            auth = {"Authorization": f"Bearer {r.keys[who]}"}
            answer = await http.post(f"{r.base}{path}", json=body, headers=auth, timeout=60)
            assert answer.status_code == 200, answer.text
            answers.append(answer.text)
        engine = await engine_cached(r)
    assert engine > 0  # the engine did reuse A's prompt for B
    for text in answers:
        assert '"cached_tokens":0' in text.replace(" ", "")
        for figure in ("timings", "__verbose", "prompt_progress", "tokens_cached", "cache_n"):
            assert figure not in text, (figure, text[:400])


@pytest.mark.parametrize("scope", [CacheScope.KEY, CacheScope.SHARED])
async def test_responses_usage_follows_the_scope(engines: Engines, scope: CacheScope) -> None:
    """Responses' input_tokens_details.cached_tokens is made from the chat
    answer's usage: hidden under key scope, the engine's under shared."""
    doc = f"{uuid.uuid4().hex} {SECRET_DOC}"
    async with router(engines, scope, ["r1"]) as r, r.client("A") as a, r.client("B") as b:
        seen = []
        for client in (a, b):
            resp = await client.responses.create(
                model=M, instructions=SYSTEM, input=doc, max_output_tokens=2, store=False
            )
            assert resp.usage is not None
            seen.append(resp.usage.input_tokens_details.cached_tokens)
        engine = await engine_cached(r)
    assert engine > 0  # B's input was found cached (A's)
    if scope is CacheScope.KEY:
        assert seen == [0, 0], (seen, engine)
    else:
        assert sum(seen) == engine and seen[1] > 0, (seen, engine)
