"""Cache-aware routing in front of real llama.cpp replicas (issue 26), driven by
the official openai client through two routers that share nothing but the
store: three llama-server processes of the tiny model (one slot each, keyed
as the routers key them), each router an app served by uvicorn whose routing
table is fed by the test (a replica drains when the test says so).

- a follow-up turn goes to the replica holding the history, through either
  router alternately, and the engine reports cached tokens for it;
- a drained replica's entries are gone from both routers;
- a replica at max_inflight is passed over for the next best;
- admission order is unchanged: a waiting request is not overtaken by a
  newcomer whose prefix the free replica holds.
"""

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import uvicorn
from openai.types.chat import ChatCompletionMessageParam

from llmgw.store import Store
from llmgw.types import (
    CacheScope,
    EngineProfile,
    ModelSpec,
    QueuePolicy,
    ReplicaMemo,
    ReplicaPhase,
    RoutingPolicy,
)
from llmgw_cli.dev.tinymodel import TinyModel
from router.admission.queue import Admission
from router.affinity.affinity import Affinity
from router.affinity.slots import EVERY_SLOT, SlotShare
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from router.control_link.routing import Route, RoutingTable
from tests.gateway_util import FakeSource
from tests.harness import free_port
from tests.llama_servers import llama_servers

if TYPE_CHECKING:
    from worker_agent.installs.llamacpp import LlamaCppInstall

M = "tiny-prefix"
REPLICAS = ("p1", "p2", "p3")
ADMIN = "prefix-admin"
CONTEXT = 2048
# Words of the tiny model's vocabulary: a few hundred tokens of shared system
# prompt, far past routing.min_match_tokens.
SYSTEM = "You answer in small words. " + "open the river light and close the tree " * 12
# A request that holds its replica's only slot for a while (the tiny model
# always generates to max_tokens), until the test lets it go.
HOLD_TOKENS = 1500  # with the prompt, within the slot's context


@dataclass
class Engines:
    endpoints: dict[str, str]  # replica id -> endpoint
    store_url: str


@contextmanager
def serving(
    llama: "LlamaCppInstall",
    tiny: TinyModel,
    root: Path,
    replicas: Sequence[str] = REPLICAS,
    context: int = CONTEXT,
    extra_args: Sequence[str] = (),
) -> Iterator[Engines]:
    """llama.cpp servers of the tiny model for ``replicas`` (one slot each
    unless ``extra_args`` say otherwise), keyed by a new store's secret."""
    store_url = f"sqlite:///{root / 'store.db'}"
    store = Store(store_url)
    store.migrate()
    secret = store.engine_key_secret()
    store.close()
    with llama_servers(llama, tiny, root, secret, M, replicas, context, extra_args) as endpoints:
        yield Engines(endpoints, store_url)


@pytest.fixture(scope="module")
def engines(
    llama: "LlamaCppInstall", tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """Three llama.cpp servers of the tiny model, one slot each."""
    with serving(llama, tiny, tmp_path_factory.mktemp("prefix")) as engines:
        yield engines


def _memo(replica: str, endpoint: str, phase: ReplicaPhase = ReplicaPhase.READY) -> ReplicaMemo:
    return ReplicaMemo(replica_id=replica, model=M, phase=phase, node_id="n1", endpoint=endpoint)


@dataclass
class Router:
    base: str
    source: FakeSource
    table: RoutingTable
    affinity: Affinity
    admission: Admission

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=300
        )

    def route(self, replica: str) -> Route:
        return next(r for r in self.table.routes[M] if r.replica_id == replica)

    def drain(self, replica: str, engines: Engines) -> None:
        self.source.items = [
            _memo(rid, ep, ReplicaPhase.DRAINING if rid == replica else ReplicaPhase.READY)
            for rid, ep in engines.endpoints.items()
        ]

    async def metrics(self) -> str:
        async with httpx.AsyncClient() as http:
            r = await http.get(f"{self.base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        return r.text


@asynccontextmanager
async def routers(
    engines: Engines,
    n: int = 2,
    routing: RoutingPolicy | None = None,
    max_inflight: int = 1,
    slot_shares: bool = False,
) -> AsyncIterator[tuple[list[Router], str]]:
    """``n`` routers over one store (each its own table and affinity), and a
    key; ``slot_shares``: router ``i`` pins slot share ``i`` of ``n``."""
    store = Store(engines.store_url)
    store.delete_model(M)
    store.put_model(
        ModelSpec(
            name=M, source="/unused.gguf", context_length=CONTEXT,
            profile=EngineProfile(max_inflight=max_inflight),
            queue=QueuePolicy(max_waiting=16, max_wait_s=240),
            routing=routing or RoutingPolicy(),
            # The tests read the engine's own cached counts, which a caller
            # sees of llama.cpp only when its cache is shared (scope.py).
            cache_scope=CacheScope.SHARED,
        )
    )  # fmt: skip
    key = create_key(store, "k", KeyPolicy())[1]
    made: list[Router] = []
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []
    try:
        for i in range(n):
            source = FakeSource([_memo(rid, ep) for rid, ep in engines.endpoints.items()])
            share = SlotShare(i, n) if slot_shares else EVERY_SLOT
            app = create_app(
                store, source, refresh_interval_s=0.05, usage_flush_interval_s=0.05,
                admin_key=ADMIN, affinity=Affinity(slot_share=share), expose_replica_header=True,
            )  # fmt: skip
            port = free_port()
            config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
            server = uvicorn.Server(config)
            servers.append((server, asyncio.create_task(server.serve())))
            base = f"http://127.0.0.1:{port}"
            await until(lambda s=server: s.started)  # type: ignore[misc]
            async with httpx.AsyncClient() as http:
                while not (await http.get(f"{base}/healthz")).json()["routing_table_loaded"]:
                    await asyncio.sleep(0.02)
            deps = app.state.deps
            made.append(Router(base, source, deps.table, deps.affinity, deps.admission))
        yield made, key
    finally:
        for server, task in servers:
            server.should_exit = True
            await task
        store.close()


async def until(cond: Callable[[], bool], timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.02)


@dataclass
class Turn:
    replica: str
    answer: str
    prompt_tokens: int
    cached_tokens: int


async def turn(
    client: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam], tokens: int = 8
) -> Turn:
    """One chat turn; the answer is appended to ``messages``."""
    raw = await client.chat.completions.with_raw_response.create(
        model=M, messages=messages, max_tokens=tokens
    )
    done = raw.parse()
    answer = done.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": answer})
    usage = done.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return Turn(
        raw.headers["x-llmgw-replica"],
        answer,
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens or 0,
    )


def conversation() -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": SYSTEM}]


def ask(messages: list[ChatCompletionMessageParam], text: str) -> None:
    messages.append({"role": "user", "content": text})


@pytest.mark.timeout(600)
async def test_alternate_turns_through_two_routers_land_where_the_history_is_cached(
    engines: Engines,
) -> None:
    async with routers(engines) as ([a, b], key):
        clients = [a.client(key), b.client(key)]
        for c in ("first", "second", "third"):
            messages = conversation()
            turns: list[Turn] = []
            for i in range(4):
                ask(messages, f"talk {c} question {i}: the green model and the blue sky")
                turns.append(await turn(clients[i % 2], messages))
            # One replica for the whole conversation, whichever router served a turn.
            assert len({t.replica for t in turns}) == 1, turns
            for before, after in itertools.pairwise(turns):
                # The engine took (about) the previous turn's whole prompt from its cache.
                assert after.cached_tokens >= before.prompt_tokens // 2, turns
        for client in clients:
            await client.close()
        for r in (a, b):
            text = await r.metrics()
            assert 'llmgw_router_route_choices_total{model="tiny-prefix",reason="prefix"}' in text
            cached = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("llmgw_router_cached_tokens_total{")
            ]
            assert sum(cached) > 0


@pytest.mark.timeout(600)
async def test_a_drained_replicas_entries_are_gone_from_both_routers(engines: Engines) -> None:
    async with routers(engines) as ([a, b], key):
        clients = [a.client(key), b.client(key)]
        messages = conversation()
        ask(messages, "a talk about the river that will drain")
        held = (await turn(clients[0], messages)).replica
        ask(messages, "and the second question about it")
        assert (await turn(clients[1], messages)).replica == held
        assert a.affinity.held_tokens(M, held) > 0 and b.affinity.held_tokens(M, held) > 0
        for r in (a, b):
            r.drain(held, engines)
        await until(
            lambda: a.affinity.held_tokens(M, held) == 0 and b.affinity.held_tokens(M, held) == 0
        )
        # Its conversation goes on elsewhere.
        ask(messages, "and a third one")
        assert (await turn(clients[0], messages)).replica != held
        for c in clients:
            await c.close()


async def _hold(r: Router, key: str, text: str) -> tuple[str, "asyncio.Task[None]"]:
    """A long streamed request through ``r``: the replica it holds, and the
    task to cancel to let it go (the client leaves: the engine stops)."""
    where: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    body: dict[str, Any] = {
        "model": M, "stream": True, "max_tokens": HOLD_TOKENS,
        "messages": [{"role": "user", "content": text}],
    }  # fmt: skip

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            headers = {"Authorization": f"Bearer {key}"}
            async with http.stream(
                "POST", f"{r.base}/v1/chat/completions", json=body, headers=headers
            ) as resp:
                where.set_result(resp.headers["x-llmgw-replica"])
                async for _ in resp.aiter_raw():
                    pass

    task = asyncio.create_task(run())
    return await asyncio.wait_for(asyncio.shield(where), 120), task


async def _release(*tasks: "asyncio.Task[None]") -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.timeout(600)
async def test_a_replica_at_max_inflight_is_passed_over_for_the_next_best(
    engines: Engines,
) -> None:
    async with routers(engines, 1) as ([a], key):
        client = a.client(key)
        history = conversation()
        ask(history, "a talk about the open light and the small tree")
        held = (await turn(client, history)).replica
        # A next turn, long: the replica holding the history is now full.
        story = [*history]
        ask(story, "tell the whole story")
        long = asyncio.create_task(turn(client, story, tokens=HOLD_TOKENS))
        await until(lambda: a.route(held).saturated())
        # Another next turn, from the same history, goes to another replica.
        short = [*history]
        ask(short, "or just the short answer")
        follow = await turn(client, short)
        assert follow.replica != held
        assert not long.done()  # served beside it, not after it
        assert (await long).replica == held
        await client.close()


@pytest.mark.timeout(600)
async def test_a_waiting_request_is_not_overtaken_by_one_whose_prefix_is_cached(
    engines: Engines,
) -> None:
    async with routers(engines, 1) as ([a], key):
        client = a.client(key)
        cached = conversation()
        ask(cached, "a talk whose history one replica holds")
        holder = (await turn(client, cached)).replica
        # Every replica full (one slot each, max_inflight 1).
        holds = dict([await _hold(a, key, f"hold {i}") for i in range(len(REPLICAS))])
        assert sorted(holds) == sorted(REPLICAS)
        # First a request whose prefix no replica holds waits ...
        first = conversation()
        ask(first, "a talk nobody has heard: the fast blue river")
        done: list[str] = []

        async def tagged(name: str, call: Awaitable[Turn]) -> Turn:
            result = await call
            done.append(name)
            return result

        waiting = asyncio.create_task(tagged("waiting", turn(client, first)))
        await until(lambda: a.admission.waiting(M) == 1)
        # ... then the cached conversation's next turn.
        ask(cached, "and its next question")
        newcomer = asyncio.create_task(tagged("newcomer", turn(client, cached)))
        await until(lambda: a.admission.waiting(M) == 2)
        # The replica holding the newcomer's history is the one set free.
        await _release(holds.pop(holder))
        await asyncio.gather(waiting, newcomer)
        assert done == ["waiting", "newcomer"]
        assert waiting.result().replica == holder  # the only free one
        await _release(*holds.values())
        await client.close()
