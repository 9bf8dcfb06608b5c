"""``/v1/responses`` on the real processes (control worker, agent, llama.cpp
replica, two router processes sharing the store), driven by the official
openai client: a conversation through ``previous_response_id`` read back from
another router; and a background response whose run is SIGKILLed with the
router running it, continued through another, and whose stream a client
resumes from a third after event N.

The background response is run by the control worker's executor (the
BackgroundResponse workflow, whose activity calls ``POST
/internal/responses/{id}/run`` on a router of ``LLMGW_ROUTER_URLS``)."""

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.store import Store
from llmgw.types import EngineKind, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from router.api.apikeys import list_keys
from router.billing import usage
from router.responses import store as rstore
from tests.harness import System, free_port, wait_routable

M = "tiny-resp"
TOKENS = 1000  # the tiny model never stops on its own: llama.cpp generates this many
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


@pytest.fixture(scope="module")
async def served(system: System, client: Client, tiny: TinyModel) -> AsyncIterator[dict[str, Any]]:
    """One llama.cpp replica behind three router processes."""
    spec = ModelSpec(
        name=M,
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        context_length=2048,
        engine_args=["--parallel", "1"],
    )
    key = system.catalog(spec)
    # The executor calls routers B then C (A, where clients come, is not among them).
    port_b, port_c = free_port(), free_port()
    system.env["LLMGW_USAGE_FLUSH_INTERVAL_S"] = "0.1"
    system.env["LLMGW_ROUTER_URLS"] = f"http://127.0.0.1:{port_b},http://127.0.0.1:{port_c}"
    started = await system.start(client, "resp-node")
    rid = await replicas.start_replica(client, spec)
    await replicas.wait_ready(client, rid, 120)
    router_b = system.start_router(port_b)
    system.start_router(port_c)
    roots = [started.root, f"http://127.0.0.1:{port_b}", f"http://127.0.0.1:{port_c}"]
    for root in roots:
        await wait_routable(f"{root}/v1", key, M)
    yield {"a": roots[0], "b": roots[1], "key": key, "router_b": router_b}
    await replicas.stop_replica(client, rid, "test over", 30)


def oai(root: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{root}/v1", api_key=key, max_retries=0)


async def test_a_conversation_is_read_back_from_another_router(
    served: dict[str, Any],
) -> None:
    async with oai(served["a"], served["key"]) as a, oai(served["b"], served["key"]) as b:
        first = await a.responses.create(model=M, input="first", max_output_tokens=8)
        async with asyncio.timeout(30):
            while True:  # stored after the answer (write-behind)
                try:
                    await b.responses.retrieve(first.id)
                    break
                except openai.NotFoundError:
                    await asyncio.sleep(0.05)
        async with b.responses.stream(
            model=M, input="second", previous_response_id=first.id, max_output_tokens=8
        ) as stream:
            events = [e async for e in stream]
        last = events[-1]
        assert last.type in ("response.completed", "response.incomplete")
        second = last.response
        assert second.previous_response_id == first.id
        assert second.usage is not None and first.usage is not None
        # The engine read the first turn too.
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def _key_id(store: Store, key: str) -> int:
    return next(k.id for k in list_keys(store) if k.prefix == key[:14])


async def _stored_until(
    store: Store, response_id: str, done: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    async with asyncio.timeout(120):
        while not done(events := rstore.events_after(store, response_id, -1)):
            await asyncio.sleep(0.02)
    return events


async def test_a_background_response_survives_the_router_running_it(
    system: System, served: dict[str, Any]
) -> None:
    """The control worker's executor runs it through router B (the first of
    LLMGW_ROUTER_URLS); B is SIGKILLed mid-generation; the activity's retry
    continues it through router C; a client resumes its stream from router A
    after the last event stored before the kill."""
    store = Store(system.store_url)
    try:
        key = store.create_api_key("background")
        key_id = _key_id(store, key)
        async with oai(served["a"], key) as a:
            resp = await a.responses.create(
                model=M, input="go", background=True, max_output_tokens=TOKENS
            )
            assert resp.status == "queued"
            await _stored_until(store, resp.id, lambda es: es[-1]["type"].endswith(".delta"))
            router_b: Child = served["router_b"]
            router_b.signal(signal.SIGKILL)  # the router running it dies mid-generation
            async with asyncio.timeout(30):
                while router_b.alive():
                    await asyncio.sleep(0.05)
            cut = rstore.events_after(store, resp.id, -1)
            assert cut[-1]["type"] == "response.output_text.delta"
            events = await _stored_until(
                store, resp.id, lambda es: es[-1]["type"] in TERMINAL_EVENTS
            )
            n = len(cut) - 1
            stream = await a.responses.retrieve(resp.id, stream=True, starting_after=n)
            resumed = [e async for e in stream]
            final = await a.responses.retrieve(resp.id)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert [e.sequence_number for e in resumed] == list(range(n + 1, len(events)))
        assert [e.type for e in resumed] == [e["type"] for e in events[n + 1 :]]
        partial = "".join(e["delta"] for e in cut if e["type"] == "response.output_text.delta")
        assert final.status == "incomplete" and len(final.output) == 1
        assert final.output_text.startswith(partial)
        deltas = sum(e["type"] == "response.output_text.delta" for e in events)
        # Not always TOKENS: the continuation's prompt re-reads the tiny
        # model's random text as more tokens, and may reach the context's end.
        assert final.usage is not None and final.usage.output_tokens >= deltas
        # Billed once, as the whole response (the killed attempt is not billed apart).
        [row] = usage.query(store, key_id=key_id)
        assert (row.requests, row.prompt_tokens, row.completion_tokens) == (
            1, final.usage.input_tokens, final.usage.output_tokens,
        )  # fmt: skip
    finally:
        store.close()
