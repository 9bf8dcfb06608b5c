"""llama.cpp slot pinning (catalog ``routing.slots``) when an engine misbehaves,
in front of a real llama-server, through the openai client:

- a slot held by a request the router does not know (another router's, or
  one that never finishes; here a long generation sent straight to the
  engine with ``id_slot``): the conversation pinned there waits, its client
  gives up, and once it waited past the router's bound (slots.STUCK_S) its
  next turns are served from another slot, cached again, while the slot
  stays held, instead of queueing behind it turn after turn;
- the engine SIGKILLed and restarted in place (same replica id, same
  endpoint) under a pinned stream: the router's slot table outlives it
  harmlessly (the restarted engine's slots are empty), the conversation is
  served in its own slot again and its turns find their history cached.
"""

import asyncio
import itertools
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import uvicorn
from openai.types.chat import ChatCompletionMessageParam

from llmgw.engine_keys import engine_key
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
from llmgw_cli.dev.tinymodel import BENCH, generate_model
from router.affinity.affinity import Affinity
from router.affinity.slots import STUCK_S
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from tests.e2e.test_prefix_routing import CONTEXT, M, Router, Turn, ask, conversation, turn, until
from tests.gateway_util import FakeSource
from tests.harness import free_port
from tests.llama_servers import healthy
from worker_agent.engines.llamacpp import pinned_slot_flags

if TYPE_CHECKING:
    from worker_agent.installs.llamacpp import LlamaCppInstall

SLOTS = 3
REPLICA = "f1"
ADMIN = "faults-admin"
# The bench's model, not the tiny one: a slot of its 16,384-token context
# takes a generation to its end minutes at ~5 ms a token on one thread
# (the tiny model, ~1 ms, caps a slot at 2,048; the portable server has no
# --context-shift to go past it).
KV_TOKENS = SLOTS * BENCH.n_ctx
# A generation that holds its slot until the test lets it go (or its
# context is full).
HOLD_TOKENS = BENCH.n_ctx


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_model(tmp_path_factory.mktemp("bench-model"), BENCH)


class Engine:
    """One llama-server of ``model`` as ``routing.slots`` runs it, keyed as a
    router keys it, that the test may SIGKILL and start again on the same
    port (log: ``root/engine.log``, appended across restarts)."""

    def __init__(self, llama: "LlamaCppInstall", model: Path, root: Path) -> None:
        store_url = f"sqlite:///{root / 'store.db'}"
        store = Store(store_url)
        store.migrate()
        self.key = engine_key(store.engine_key_secret(), REPLICA)
        store.close()
        self.store_url = store_url
        self.log = root / "engine.log"
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._env = llama.environment(os.environ) | {"LLAMA_API_KEY": self.key}
        self._argv = [
            str(llama.server), "--model", str(model), "--alias", M,
            "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(KV_TOKENS),
            "--threads", "1", "--no-webui", *pinned_slot_flags(SLOTS),
        ]  # fmt: skip
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen(
                self._argv, env=self._env, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 120
        while not healthy(self.endpoint):
            assert self._proc.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, "llama.cpp did not start"
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: no cleanup, connections reset."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGKILL)
        self._proc.wait(30)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)

    async def slots(self) -> list[dict[str, Any]]:
        """The engine's own view of its slots (``GET /slots``)."""
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(
                f"{self.endpoint}/slots", headers={"Authorization": f"Bearer {self.key}"}
            )
        r.raise_for_status()
        slots: list[dict[str, Any]] = r.json()
        return slots

    def asked_for_busy(self, slot: int) -> int:
        """Requests that asked for ``slot`` while it was busy: llama.cpp logs
        the busy slot's task beside each attempt to place a deferred one."""
        busy = re.compile(rf"id +{slot} \| task (\d+) \| selected slot by id \({slot}\)")
        return len(busy.findall(self.log.read_text(errors="replace")))


@contextmanager
def engine(llama: "LlamaCppInstall", model: Path, root: Path) -> Iterator[Engine]:
    e = Engine(llama, model, root)
    try:
        e.start()
        yield e
    finally:
        e.stop()


@asynccontextmanager
async def router(e: Engine, affinity: Affinity) -> AsyncIterator[tuple[Router, str]]:
    """A router (uvicorn) whose routing table holds the one replica, pinning
    ``SLOTS`` slots, its affinity the test's; and an API key."""
    store = Store(e.store_url)
    store.delete_model(M)
    store.put_model(
        ModelSpec(
            name=M, source="/unused.gguf", context_length=CONTEXT,
            profile=EngineProfile(max_inflight=SLOTS + 1),
            queue=QueuePolicy(max_waiting=16, max_wait_s=240),
            routing=RoutingPolicy(slots=SLOTS),
            # The tests read the engine's own cached counts, which a caller
            # sees of llama.cpp only when its cache is shared (scope.py).
            cache_scope=CacheScope.SHARED,
        )
    )  # fmt: skip
    key = create_key(store, "k", KeyPolicy())[1]
    memo = ReplicaMemo(
        replica_id=REPLICA, model=M, phase=ReplicaPhase.READY, node_id="n1", endpoint=e.endpoint
    )
    source = FakeSource([memo])
    app = create_app(
        store, source, refresh_interval_s=0.05, usage_flush_interval_s=0.05, admin_key=ADMIN,
        affinity=affinity, expose_replica_header=True,
    )  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    try:
        await until(lambda: server.started)
        async with httpx.AsyncClient() as http:
            while not (await http.get(f"{base}/healthz")).json()["routing_table_loaded"]:
                await asyncio.sleep(0.02)
        deps = app.state.deps
        yield Router(base, source, deps.table, deps.affinity, deps.admission), key
    finally:
        server.should_exit = True
        await task
        store.close()


async def where(
    e: Engine, client: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam]
) -> tuple[Turn, int]:
    """One chat turn, and the slot that served it: the one whose last task
    changed meanwhile (one request at a time here, besides a held slot's,
    which keeps its task)."""
    before = {s["id"]: s.get("id_task") for s in await e.slots()}
    done = await turn(client, messages)
    moved = [s["id"] for s in await e.slots() if s.get("id_task") != before.get(s["id"])]
    assert len(moved) == 1, (before, moved)
    return done, int(moved[0])


async def hold(e: Engine, slot: int) -> "asyncio.Task[None]":
    """A long generation sent straight to the engine pinned to ``slot``:
    a request no router knows. Returns once the engine is generating it."""
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    body = {
        "model": M, "stream": True, "max_tokens": HOLD_TOKENS, "id_slot": slot,
        "messages": [{"role": "user", "content": "tell the longest story"}],
    }  # fmt: skip

    async def run() -> None:
        headers = {"Authorization": f"Bearer {e.key}"}
        async with (
            httpx.AsyncClient(timeout=None) as http,
            http.stream(
                "POST", f"{e.endpoint}/v1/chat/completions", json=body, headers=headers
            ) as r,
        ):
            async for _ in r.aiter_raw():
                if not started.done():
                    started.set_result(None)

    task = asyncio.create_task(run())
    async with asyncio.timeout(120):
        await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
    assert started.done(), task
    return task


async def stop(*tasks: "asyncio.Task[Any]") -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Skewed:
    """The router's monotonic clock, moved ahead by the test: a wait it
    watches counts as long as the test says, however fast the machine."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


@pytest.mark.timeout(600)
async def test_a_slot_held_by_a_request_the_router_does_not_know_is_left_for_another(
    llama: "LlamaCppInstall", model: Path, tmp_path: Path
) -> None:
    clock = Skewed()
    with engine(llama, model, tmp_path) as e:
        async with router(e, Affinity(clock=clock)) as (r, key):
            client = r.client(key)
            talk = conversation()
            ask(talk, "talk one: the green model and the blue sky")
            _, pinned = await where(e, client, talk)
            held = await hold(e, pinned)
            try:
                # The next turn, streamed, is pinned to the held slot: the
                # engine queues it (a whole answer would be awaited even with
                # its client gone, its slot busy in the router until then).
                ask(talk, "talk one, question two")
                asked = e.asked_for_busy(pinned)
                waiting = asyncio.create_task(_stream(client, [*talk], asyncio.Event()))
                await until(lambda: e.asked_for_busy(pinned) > asked, 120)
                assert not waiting.done()
                # It waits past the bound (the router's clock says so), and
                # its client gives up.
                clock.ahead += STUCK_S
                await stop(waiting)
                await until(lambda: r.route(REPLICA).inflight == 0, 120)
                # The same turn again, and the next: served beside the held
                # slot (without the block, pinned to it again: queued behind
                # it, and this times out).
                async with asyncio.timeout(180):
                    again, moved = await where(e, client, talk)
                    ask(talk, "talk one, question three")
                    then, kept = await where(e, client, talk)
                assert moved != pinned and kept == moved
                # The conversation keeps its new slot, its history cached there.
                assert then.cached_tokens >= again.prompt_tokens - 1, (again, then)
                assert not held.done()  # the held slot was held all along
                assert next(s for s in await e.slots() if s["id"] == pinned)["is_processing"]
            finally:
                await stop(held)
                await client.close()


async def _stream(
    client: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam], started: asyncio.Event
) -> None:
    """A long streamed turn, cut short by whatever happens to its engine."""
    stream = await client.chat.completions.create(
        model=M, messages=messages, max_tokens=HOLD_TOKENS, stream=True
    )
    async for _ in stream:
        started.set()


@pytest.mark.timeout(600)
async def test_an_engine_killed_and_restarted_in_place_serves_the_conversation_from_its_slot(
    llama: "LlamaCppInstall", model: Path, tmp_path: Path
) -> None:
    with engine(llama, model, tmp_path) as e:
        async with router(e, Affinity()) as (r, key):
            client = r.client(key)
            talk = conversation()
            turns: list[Turn] = []
            for n in ("one", "two"):
                ask(talk, f"talk one, question {n}: the green model and the blue sky")
                done, slot = await where(e, client, talk)
                turns.append(done)
            assert turns[1].cached_tokens >= turns[0].prompt_tokens - 1, turns
            # A long turn of the conversation is being streamed from its slot
            # when the engine is SIGKILLed; the engine comes back in place.
            started = asyncio.Event()
            story = [*talk]
            ask(story, "tell the whole story")
            cut = asyncio.create_task(_stream(client, story, started))
            async with asyncio.timeout(120):
                await started.wait()
            e.kill()
            async with asyncio.timeout(120):
                await asyncio.gather(cut, return_exceptions=True)  # cut short, somehow
            await until(lambda: r.route(REPLICA).inflight == 0, 120)
            await asyncio.to_thread(e.start)
            # Its next turns: served, in its own slot (the router's table
            # outlived the engine: nothing there is busy), which computes
            # the history once and then holds it again.
            after: list[Turn] = []
            for n in ("three", "four", "five"):
                ask(talk, f"talk one, question {n}")
                done, again = await where(e, client, talk)
                assert again == slot
                after.append(done)
            assert after[0].cached_tokens < turns[1].prompt_tokens  # the cache died with it
            for before, now in itertools.pairwise(after):
                assert now.cached_tokens >= before.prompt_tokens - 1, after
            await client.close()
