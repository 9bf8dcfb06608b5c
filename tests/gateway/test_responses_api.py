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
from llmgw.store.openai_tables import ResponseRecord
from router.api.apikeys import create_key, list_keys
from router.app import create_app
from router.billing import usage
from router.billing.key_policy import KeyPolicy
from router.responses import store as rstore
from tests.gateway.test_admission_llama import REPLICA, Engine, M, engine, model, until
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

    def start_batch(self, batch_id: str) -> None:
        raise AssertionError("no batch here")

    def cancel_batch(self, batch_id: str) -> None:
        raise AssertionError("no batch here")

    async def aclose(self) -> None:
        pass


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
    jobs = FakeJobs()
    app = create_app(
        store, FakeSource([ready(REPLICA, M, engine.endpoint)]),
        refresh_interval_s=0.05, usage_flush_interval_s=0.05, jobs=jobs,
    )  # fmt: skip
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
            with pytest.raises(openai.BadRequestError) as no_events:
                await client.responses.retrieve(resp.id, stream=True)
            assert no_events.value.param == "stream"  # only background ones keep events
            assert again.usage == resp.usage
            items = [i async for i in client.responses.input_items.list(resp.id)]
            assert [(i.type, i.role) for i in items] == [("message", "user")]  # type: ignore[union-attr]
            assert items[0].content[0].text == "hello"  # type: ignore[union-attr,index]


async def test_items_instructions_and_the_typed_stream(engine: Engine) -> None:
    async with router(engine) as r:
        key, _ = r.key()
        async with r.client(key) as client:
            turns: list[Any] = [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "two"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "3"}],
                },
            ]
            async with client.responses.stream(
                model=M,
                input=turns,
                instructions="Count.",
                max_output_tokens=8,
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


async def test_a_stream_its_client_left_is_kept_cancelled_with_what_it_was_sent(
    engine: Engine,
) -> None:
    async with router(engine) as r:
        key, _ = r.key()
        async with r.client(key) as client:
            stream = await client.responses.create(
                model=M, input="go on", stream=True, max_output_tokens=1500
            )
            text, response_id = "", ""
            async for event in stream:
                if event.type == "response.created":
                    response_id = event.response.id
                if event.type == "response.output_text.delta":
                    text += event.delta
                    if len(text) > 20:
                        break
            await stream.close()  # the client leaves mid-stream
            kept = await stored(r, client, response_id)
            assert kept.status == "cancelled"
            assert kept.output_text.startswith(text)
            # The engine was let go: nothing in flight once it was stored.
            await until(lambda: sum(x.inflight for x in r.app.state.deps.table.routes[M]) == 0)


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
            assert resp.text is not None and resp.text.format is not None
            assert resp.text.format.type == "json_schema"


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
            assert [i.content[0].text for i in items] == ["second turn"]  # type: ignore[union-attr,index]


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
            await client.responses.delete(resp.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(resp.id)
            with pytest.raises(openai.BadRequestError) as deleted:
                await client.responses.create(
                    model=M, input="x", previous_response_id=resp.id, max_output_tokens=4
                )
            assert deleted.value.code == "previous_response_not_found"
            assert deleted.value.param == "previous_response_id"
            with pytest.raises(openai.BadRequestError) as bad:
                await client.responses.create(model=M, input="x", tools=[{"type": "web_search"}])
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


def with_exec(r: Router, key_id: int) -> dict[str, str]:
    """The headers the executor sends a router for the key (contract §1)."""
    token = exec_token(r.store.engine_key_secret(), key_id)
    return {"Authorization": f"Bearer {token}", "X-Llmgw-Key-Id": str(key_id)}


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        if line.startswith("data:"):
            yield json.loads(line[5:])


def long_run(r: Router, key_id: int, response_id: str, tokens: int) -> None:
    """The stored request made long: llama.cpp generates ``tokens`` whatever the
    tiny model says (it never stops on its own)."""
    with r.store.session() as session:
        record = session.get(ResponseRecord, response_id)
        assert record is not None and record.key_id == key_id
        record.request = {
            **record.request,
            "chat": {**record.request["chat"], "ignore_eos": True, "max_tokens": tokens},
        }
        session.add(record)
        session.commit()


def stored_events(r: Router, response_id: str) -> list[dict[str, Any]]:
    return rstore.events_after(r.store, response_id, -1)


async def cut_short(
    r: Router, http: httpx.AsyncClient, run: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """A first attempt, its connection closed once some text is stored (the
    executor killed): the events stored by then."""
    async with http.stream("POST", run, headers=headers) as first:
        assert first.status_code == 200
        async for event in sse_events(first.aiter_lines()):
            if event["type"] == "response.output_text.delta":
                break
    # The router ends the engine's request as for any client that left.
    await until(lambda: sum(x.inflight for x in r.app.state.deps.table.routes[M]) == 0)
    return stored_events(r, run.split("/")[-2])


async def resumed_from(r: Router, key: str, response_id: str, after: int) -> list[Any]:
    """The events the openai client streams from ``r`` after event ``after``."""
    async with r.client(key) as client:
        stream = await client.responses.retrieve(response_id, stream=True, starting_after=after)
        return [e async for e in stream]


async def test_a_background_run_killed_midway_continues_from_its_stored_events(
    engine: Engine,
) -> None:
    tokens = 400
    async with router(engine) as r, router(engine, put_model=False) as second:
        key, key_id = r.key()
        headers = with_exec(r, key_id)
        async with r.client(key) as client, httpx.AsyncClient(timeout=120) as http:
            resp = await client.responses.create(
                model=M, input="go on", background=True, max_output_tokens=tokens
            )
            long_run(r, key_id, resp.id, tokens)
            run = f"{r.base}/internal/responses/{resp.id}/run"
            # Not the executor: refused.
            refused = await http.post(run, headers={"Authorization": f"Bearer {key}"})
            assert refused.status_code == 401
            cut = await cut_short(r, http, run, headers)
            assert cut[-1]["type"] != "response.incomplete"
            partial = "".join(e["delta"] for e in cut if e["type"] == "response.output_text.delta")
            assert partial
            got = await client.responses.retrieve(resp.id)
            assert got.status == "in_progress"
            # Another key's id: not found. The second attempt continues (the
            # executor need not name the key: the response's own is used).
            wrong = await http.post(run, headers={**headers, "X-Llmgw-Key-Id": str(key_id + 99)})
            assert wrong.status_code == 404
            answer = await http.post(run, headers={"Authorization": headers["Authorization"]})
            assert answer.status_code == 200
            final = await client.responses.retrieve(resp.id)
            events = stored_events(r, resp.id)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert final.status == "incomplete"  # the tiny model stops only at max tokens
            assert final.incomplete_details is not None
            assert final.incomplete_details.reason == "max_output_tokens"
            [message] = final.output
            assert message.type == "message"
            assert final.output_text.startswith(partial)
            assert [e["type"] for e in events].count("response.output_item.added") == 1
            assert events[-1]["type"] == "response.incomplete"
            record = rstore.get_response(r.store, key_id, resp.id)
            assert record is not None and record.billed_at is not None
            # Run again: it has ended, nothing more is written or billed.
            again = await http.post(run, headers=headers)
            assert again.json() == {"id": resp.id, "status": "incomplete"}
            assert stored_events(r, resp.id) == events
            assert not rstore.finish_run(r.store, resp.id, final.model_dump())
            # Billed once, the whole response: no row for the attempt cut short.
            [row] = usage.query(r.store, key_id=key_id)
            assert final.usage is not None and final.usage.output_tokens == tokens
            assert (row.requests, row.prompt_tokens, row.completion_tokens) == (
                1, final.usage.input_tokens, final.usage.output_tokens,
            )  # fmt: skip
            # Resumed from ANOTHER router, after event n: exactly the rest.
            n = len(cut) - 1
            resumed = await resumed_from(second, key, resp.id, n)
            assert [e.sequence_number for e in resumed] == list(range(n + 1, len(events)))
            assert [(e.type, getattr(e, "delta", None)) for e in resumed] == [
                (e["type"], e.get("delta")) for e in events[n + 1 :]
            ]
            print(f"cut after {len(cut)} events, {len(events)} in all")
            # The client's own helper replays from the start.
            async with client.responses.stream(response_id=resp.id) as replay:
                types = [e.type async for e in replay]
            assert types == [e["type"] for e in events]


async def test_a_background_stream_follows_the_run_and_a_cancel_stops_it(engine: Engine) -> None:
    async with router(engine) as r:
        key, key_id = r.key()
        headers = with_exec(r, key_id)
        async with r.client(key) as client, httpx.AsyncClient(timeout=120) as http:
            # background + stream: the client follows the stored events as the run writes them.
            stream = await client.responses.create(
                model=M, input="hi", background=True, stream=True, max_output_tokens=16
            )
            [resp_id] = r.jobs.started
            run = asyncio.create_task(
                http.post(f"{r.base}/internal/responses/{resp_id}/run", headers=headers)
            )
            followed = [e async for e in stream]
            assert (await run).status_code == 200
            stored = stored_events(r, resp_id)
            assert [e.sequence_number for e in followed] == list(range(len(stored)))
            assert followed[1].type == "response.queued"
            assert followed[-1].type == "response.incomplete"
            # Cancelled while it runs: the run stops at its next flush.
            resp = await client.responses.create(
                model=M, input="go on", background=True, max_output_tokens=1500
            )
            long_run(r, key_id, resp.id, 1500)
            url = f"{r.base}/internal/responses/{resp.id}/run"
            async with http.stream("POST", url, headers=headers) as running:
                lines = sse_events(running.aiter_lines())
                async for event in lines:
                    if event["type"] == "response.output_text.delta":
                        assert (await client.responses.cancel(resp.id)).status == "cancelled"
                        break
                rest = [e async for e in lines]
            # It stopped at a flush after the cancel, far from its 1500 tokens.
            assert rest and len(stored_events(r, resp.id)) < 1500
            assert r.jobs.cancelled == [resp.id]
            await until(lambda: sum(x.inflight for x in r.app.state.deps.table.routes[M]) == 0)
            final = await client.responses.retrieve(resp.id)
            assert final.status == "cancelled"
            assert stored_events(r, resp.id)[-1]["type"] == "response.output_text.delta"
            # A stream of it ends (OpenAI has no cancelled event).
            replay = await client.responses.retrieve(resp.id, stream=True)
            assert [e async for e in replay][-1].type == "response.output_text.delta"
            again = await http.post(url, headers=headers)
            assert again.json() == {"id": resp.id, "status": "cancelled"}
            # Billed: the first in full, the cancelled one a token a stored delta.
            first = await client.responses.retrieve(resp_id)
            assert first.usage is not None
            deltas = [e for e in stored_events(r, resp.id) if e["type"].endswith(".delta")]
            [row] = usage.query(r.store, key_id=key_id)
            assert (row.requests, row.errors) == (2, 1)
            assert row.completion_tokens == first.usage.output_tokens + len(deltas)


async def test_a_continuation_with_no_room_left_ends_incomplete_keeping_its_text(
    engine: Engine,
) -> None:
    # The partial text, tokenized anew in the continuation's prompt, can take
    # more of the context than it was generated as: seen with 926 stored
    # deltas in a 2,048-token slot. The output then ends as at its limit.
    async with router(engine) as r:
        key, key_id = r.key()
        headers = with_exec(r, key_id)
        async with r.client(key) as client, httpx.AsyncClient(timeout=120) as http:
            resp = await client.responses.create(
                model=M, input="go on", background=True, max_output_tokens=400
            )
            long_run(r, key_id, resp.id, 400)
            run = f"{r.base}/internal/responses/{resp.id}/run"
            cut = await cut_short(r, http, run, headers)
            last = next(e for e in reversed(cut) if e["type"] == "response.output_text.delta")
            filler = " word" * 3000  # past the engine's 2,048-token context
            grown = {**last, "sequence_number": cut[-1]["sequence_number"] + 1, "delta": filler}
            rstore.append_events(r.store, resp.id, [grown])
            answer = await http.post(run, headers=headers)
            assert answer.status_code == 200
            final = await client.responses.retrieve(resp.id)
            assert final.status == "incomplete", final.error
            assert final.incomplete_details is not None
            assert final.incomplete_details.reason == "max_output_tokens"
            assert final.output_text.endswith(filler)
            assert stored_events(r, resp.id)[-1]["type"] == "response.incomplete"
            # Billed once: a token a stored delta (its prompt is not known).
            deltas = [e for e in stored_events(r, resp.id) if e["type"].endswith(".delta")]
            assert final.usage is not None and final.usage.output_tokens == len(deltas)
            [row] = usage.query(r.store, key_id=key_id)
            assert (row.requests, row.completion_tokens) == (1, len(deltas))


async def test_a_log_that_cannot_be_continued_fails_the_response(engine: Engine) -> None:
    async with router(engine) as r:
        key, key_id = r.key()
        async with r.client(key) as client, httpx.AsyncClient(timeout=60) as http:
            resp = await client.responses.create(
                model=M, input="hi", background=True, max_output_tokens=8
            )
            # A gap in the stored numbering (3 is missing).
            gap = {"type": "response.in_progress", "sequence_number": 4, "response": {}}
            rstore.append_events(r.store, resp.id, [gap])
            answer = await http.post(
                f"{r.base}/internal/responses/{resp.id}/run", headers=with_exec(r, key_id)
            )
            assert answer.json() == {"id": resp.id, "status": "failed"}
            final = await client.responses.retrieve(resp.id)
            assert final.status == "failed" and final.error is not None
            assert stored_events(r, resp.id)[-1]["type"] == "response.failed"
