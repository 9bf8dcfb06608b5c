"""``/v1/responses`` on the real processes (control worker, agent, llama.cpp
replica, two router processes sharing the store), driven by the official
openai client: a conversation through ``previous_response_id`` read back from
the other router; and a background response whose run is SIGKILLed with the
router running it, continued on the second router, and whose stream a client
resumes there after event N.

The test plays the executor (``POST /internal/responses/{id}/run`` with the
exec token, contract §4): the control worker's own runs are tested with it."""

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.engine_keys import exec_token
from llmgw.store import Store
from llmgw.store.openai_tables import ResponseRecord
from llmgw.types import EngineKind, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from router.api.apikeys import list_keys
from router.billing import usage
from router.responses import store as rstore
from tests.harness import System, free_port, wait_routable

M = "tiny-resp"
TOKENS = 1500  # the tiny model never stops on its own: llama.cpp generates this many


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


@pytest.fixture(scope="module")
async def served(system: System, client: Client, tiny: TinyModel) -> AsyncIterator[dict[str, Any]]:
    """One llama.cpp replica behind two router processes."""
    spec = ModelSpec(
        name=M,
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        context_length=2048,
        engine_args=["--parallel", "1"],
    )
    key = system.catalog(spec)
    system.env["LLMGW_USAGE_FLUSH_INTERVAL_S"] = "0.1"
    started = await system.start(client, "resp-node")
    rid = await replicas.start_replica(client, spec)
    await replicas.wait_ready(client, rid, 120)
    port = free_port()
    second = system.start_router(port)
    other = f"http://127.0.0.1:{port}"
    for root in (started.root, other):
        await wait_routable(f"{root}/v1", key, M)
    router_a = next(c for c in system.children if c.name == "router" and c is not second)
    yield {"a": started.root, "b": other, "key": key, "router_a": router_a}
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


def _long_and_claimed(store: Store, response_id: str) -> None:
    """The stored request made long, and marked started: the test is its
    executor (the control worker's sweeper leaves it alone)."""
    with store.session() as session:
        record = session.get(ResponseRecord, response_id)
        assert record is not None
        chat = {**record.request["chat"], "ignore_eos": True, "max_tokens": TOKENS}
        record.request = {**record.request, "chat": chat}
        record.started_at = int(time.time())
        session.add(record)
        session.commit()


async def _run_until_text(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> None:
    async with http.stream("POST", url, headers=headers) as run:
        assert run.status_code == 200
        async for line in run.aiter_lines():
            if line.startswith("data:") and json.loads(line[5:])["type"].endswith(".delta"):
                return


async def test_a_background_run_survives_its_router_and_resumes_elsewhere(
    system: System, served: dict[str, Any]
) -> None:
    store = Store(system.store_url)
    try:
        key = store.create_api_key("background")
        key_id = _key_id(store, key)
        headers = {
            "Authorization": f"Bearer {exec_token(store.engine_key_secret())}",
            "X-Llmgw-Key-Id": str(key_id),
        }
        async with oai(served["a"], key) as a, oai(served["b"], key) as b:
            resp = await a.responses.create(
                model=M, input="go", background=True, max_output_tokens=TOKENS
            )
            assert resp.status == "queued"
            _long_and_claimed(store, resp.id)
            async with httpx.AsyncClient(timeout=300) as http:
                await _run_until_text(
                    http, f"{served['a']}/internal/responses/{resp.id}/run", headers
                )
                router_a: Child = served["router_a"]
                router_a.signal(signal.SIGKILL)  # the router running it dies
                async with asyncio.timeout(30):
                    while router_a.alive():
                        await asyncio.sleep(0.05)
                cut = rstore.events_after(store, resp.id, -1)
                assert cut[-1]["type"] == "response.output_text.delta"
                assert (await b.responses.retrieve(resp.id)).status == "in_progress"
                # The executor's retry, on the other router, continues it.
                again = await http.post(
                    f"{served['b']}/internal/responses/{resp.id}/run", headers=headers
                )
                assert again.status_code == 200
            n = len(cut) - 1
            stream = await b.responses.retrieve(resp.id, stream=True, starting_after=n)
            resumed = [e async for e in stream]
            final = await b.responses.retrieve(resp.id)
        events = rstore.events_after(store, resp.id, -1)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert [e.sequence_number for e in resumed] == list(range(n + 1, len(events)))
        assert [e.type for e in resumed] == [e["type"] for e in events[n + 1 :]]
        partial = "".join(e["delta"] for e in cut if e["type"] == "response.output_text.delta")
        assert final.status == "incomplete" and len(final.output) == 1
        assert final.output_text.startswith(partial)
        assert final.usage is not None and final.usage.output_tokens == TOKENS
        # Billed once, as the whole response (the killed attempt is not billed apart).
        [row] = usage.query(store, key_id=key_id)
        assert (row.requests, row.completion_tokens) == (1, TOKENS)
    finally:
        store.close()
