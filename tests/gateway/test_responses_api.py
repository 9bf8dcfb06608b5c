"""``/v1/responses`` through the official openai client against the router app
(served by uvicorn) in front of a real llama.cpp engine (the module-scoped
engine of tests/gateway/test_admission_llama.py): create with a string, items,
instructions and a json_schema format; the typed event stream; retrieve,
input_items, delete and cancel; previous_response_id; ownership; usage in the
usage table like any chat request; background responses started through an
injected Jobs and run by ``/internal/responses/{id}/run``."""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from llmgw.engine_keys import exec_token
from llmgw.store import Store
from router.api.apikeys import create_key, list_keys
from router.app import create_app
from router.billing import usage
from router.billing.key_policy import KeyPolicy
from router.responses import store as rstore
from tests.gateway.test_admission_llama import M, REPLICA, Engine, engine, model, until
from tests.gateway_util import FakeSource, ready
from tests.harness import free_port

__all__ = ["engine"]


@dataclass
class FakeJobs:
    """The executor link, as the router calls it (contract §5)."""

    started: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def start_response(self, response_id: str) -> None:
        self.started.append(response_id)

    def cancel_response(self, response_id: str) -> None:
        self.cancelled.append(response_id)


@dataclass
class Router:
    base: str
    store: Store
    app: FastAPI
    jobs: FakeJobs

    def key(self) -> tuple[str, int]:
        key = create_key(self.store, "k", KeyPolicy())[1]
        return key, next(k.id for k in list_keys(self.store) if k.prefix == key[:14])

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0)


@asynccontextmanager
async def router(engine: Engine, put_model: bool = True) -> AsyncIterator[Router]:
    store = Store(engine.store_url)
    if put_model:
        store.delete_model(M)
        store.put_model(model())
    app = create_app(
        store, FakeSource([ready(REPLICA, M, engine.endpoint)]),
        refresh_interval_s=0.05, usage_flush_interval_s=0.05,
    )  # fmt: skip
    jobs = FakeJobs()
    app.state.jobs = jobs
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as http:
        await until(lambda: server.started)
        while not (await http.get(f"{base}/healthz")).json()["routing_table_loaded"]:
            await asyncio.sleep(0.02)
    try:
        yield Router(base, store, app, jobs)
    finally:
        server.should_exit = True
        await task
        store.close()


async def stored(r: Router, client: openai.AsyncOpenAI, response_id: str) -> Any:
    """The stored response, once the write-behind has written it."""
    async with asyncio.timeout(30):
        while True:
            try:
                return await client.responses.retrieve(response_id)
            except openai.NotFoundError:
                await asyncio.sleep(0.02)


async def test_create_string_input_retrieve_and_input_items(engine: Engine) -> None:
    async with router(engine) as r:
        key, _ = r.key()
        async with r.client(key) as client:
            resp = await client.responses.create(model=M, input="hello", max_output_tokens=8)
            assert resp.id.startswith("resp_") and resp.object == "response"
            assert resp.status in ("completed", "incomplete")
            assert resp.output_text
            assert resp.usage is not None and resp.usage.output_tokens > 0
            again = await stored(r, client, resp.id)
            assert again.output_text == resp.output_text
            assert again.usage == resp.usage
            items = [i async for i in client.responses.input_items.list(resp.id)]
            assert [(i.type, i.role) for i in items] == [("message", "user")]  # type: ignore[union-attr]
            assert items[0].content[0].text == "hello"  # type: ignore[union-attr]


async def test_items_instructions_and_the_typed_stream(engine: Engine) -> None:
    async with router(engine) as r:
        key, _ = r.key()
        async with r.client(key) as client:
            turns = [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "two"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "3"}]},
            ]
            async with client.responses.stream(
                model=M, input=turns, instructions="Count.", max_output_tokens=8  # type: ignore[arg-type]
            ) as stream:
                events = [event async for event in stream]
            kinds = [e.type for e in events]
            final = events[-1].response  # type: ignore[union-attr]
            assert kinds[:4] == [
                "response.created", "response.in_progress",
                "response.output_item.added", "response.content_part.added",
            ]  # fmt: skip
            assert "response.output_text.delta" in kinds
            assert kinds[-1] in ("response.completed", "response.incomplete")
            assert final.instructions == "Count." and final.output_text
            await stored(r, client, final.id)
            page = await client.responses.input_items.list(final.id, order="asc", limit=2)
            assert [i.id for i in page.data] and page.has_more
            items = [i async for i in client.responses.input_items.list(final.id, limit=1)]
            assert [i.role for i in items] == ["user", "assistant", "user"]  # type: ignore[union-attr]
            assert len({i.id for i in items}) == 3


async def test_json_schema_output_is_constrained(engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    async with router(engine) as r:
        key, _ = r.key()
        async with r.client(key) as client:
            resp = await client.responses.create(
                model=M, input="a number", max_output_tokens=64,
                text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
            )  # fmt: skip
            assert resp.status == "completed"
            assert isinstance(json.loads(resp.output_text)["n"], int)
            assert resp.text is not None and resp.text.format.type == "json_schema"


async def test_previous_response_id_carries_the_conversation(engine: Engine) -> None:
    async with router(engine) as r:
        key, key_id = r.key()
        async with r.client(key) as client:
            first = await client.responses.create(model=M, input="first turn", max_output_tokens=8)
            await stored(r, client, first.id)
            second = await client.responses.create(
                model=M, input="second turn", previous_response_id=first.id, max_output_tokens=8
            )
            assert second.previous_response_id == first.id
            await stored(r, client, second.id)
            record = rstore.get_response(r.store, key_id, second.id)
            assert record is not None
            messages = record.request["chat"]["messages"]
            assert messages == [
                {"role": "user", "content": "first turn"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "second turn"},
            ]
            # The engine was sent the first turn: it counted its tokens.
            assert second.usage is not None and first.usage is not None
            assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
            # Only the second request's own input is its input items.
            items = [i async for i in client.responses.input_items.list(second.id)]
            assert [i.content[0].text for i in items] == ["second turn"]  # type: ignore[union-attr]


async def test_deleted_foreign_and_unknown_ids(engine: Engine) -> None:
    async with router(engine) as r:
        key, _ = r.key()
        other, _ = r.key()
        async with r.client(key) as client, r.client(other) as stranger:
            resp = await client.responses.create(model=M, input="hi", max_output_tokens=4)
            await stored(r, client, resp.id)
            # Another key: as if it did not exist.
            for call in (
                stranger.responses.retrieve(resp.id),
                stranger.responses.input_items.list(resp.id),
                stranger.responses.delete(resp.id),
                stranger.responses.cancel(resp.id),
            ):
                with pytest.raises(openai.NotFoundError) as missing:
                    await call
                assert missing.value.body["message"] == f"Response with id '{resp.id}' not found."  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as foreign:
                await stranger.responses.create(
                    model=M, input="x", previous_response_id=resp.id, max_output_tokens=4
                )
            assert foreign.value.code == "previous_response_not_found"
            # A foreground response cannot be cancelled.
            with pytest.raises(openai.BadRequestError) as sync:
                await client.responses.cancel(resp.id)
            assert "synchronous" in sync.value.message
            # Deleted: gone for GET, and as a previous response.
            assert await client.responses.delete(resp.id) is None
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(resp.id)
            with pytest.raises(openai.BadRequestError) as deleted:
                await client.responses.create(
                    model=M, input="x", previous_response_id=resp.id, max_output_tokens=4
                )
            assert deleted.value.code == "previous_response_not_found"
            assert deleted.value.param == "previous_response_id"
            with pytest.raises(openai.BadRequestError) as bad:
                await client.responses.create(model=M, input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
            assert bad.value.param == "tools[0]"


async def test_usage_is_billed_like_a_chat_request(engine: Engine) -> None:
    async with router(engine) as r:
        key, key_id = r.key()
        async with r.client(key) as client:
            resp = await client.responses.create(
                model=M, input="hi", max_output_tokens=6, store=False
            )
            assert resp.usage is not None
            async with client.responses.stream(model=M, input="hi", max_output_tokens=6) as s:
                streamed = [e async for e in s][-1].response  # type: ignore[union-attr]
            assert streamed.usage is not None
        rows: list[usage.UsageRow] = []

        def billed() -> bool:
            rows[:] = usage.query(r.store, key_id=key_id)
            return bool(rows) and rows[0].requests == 2

        await until(billed, timeout_s=30)
        [row] = rows
        assert row.model == M
        assert row.prompt_tokens == resp.usage.input_tokens + streamed.usage.input_tokens
        assert row.completion_tokens == resp.usage.output_tokens + streamed.usage.output_tokens
        # store=false: nothing kept.
        assert rstore.get_response(r.store, key_id, resp.id) is None


async def test_background_is_queued_at_once_and_cancellable(engine: Engine) -> None:
    async with router(engine) as r:
        key, _ = r.key()
        async with r.client(key) as client:
            resp = await client.responses.create(
                model=M, input="hi", background=True, max_output_tokens=8
            )
            assert resp.status == "queued" and resp.background
            assert r.jobs.started == [resp.id]
            got = await client.responses.retrieve(resp.id)
            assert got.status == "queued"
            cancelled = await client.responses.cancel(resp.id)
            assert cancelled.status == "cancelled"
            assert r.jobs.cancelled == [resp.id]
            # A finished one is returned unchanged.
            assert (await client.responses.cancel(resp.id)).status == "cancelled"
            assert r.jobs.cancelled == [resp.id]
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=M, input="x", background=True, store=False)
            assert refused.value.param == "background"


def exec_headers(r: Router, key_id: int) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {exec_token(r.store.engine_key_secret())}",
        "X-Llmgw-Key-Id": str(key_id),
    }
