"""``/v1/responses`` within bounds (issue 34): a background response takes
its quota when it is created (and its run takes no more); what a response
stores is measured before it is stored, its chain counted; a key's stored
responses are bounded; a failed response cannot be continued; a run past
its attempts or its deadline ends failed. Through the real router app (a
mock engine), on SQLite and PostgreSQL."""

import asyncio
import json
import time
from typing import Any, cast

import httpx
import psycopg
import pytest
from sqlmodel import func, select

from llmgw.store import Store
from llmgw.store.openai_tables import ResponseRecord
from router.responses import store as rstore
from router.responses.bounds import MAX_RUN_ATTEMPTS, RUN_DEADLINE_S, ResponseBounds, run_refusal
from router.responses.chain import ChainTooLarge, PreviousFailed, load_chain
from router.responses.ending import ABANDONED_AFTER_S
from tests.gateway.test_files_store_frozen import waiting
from tests.gateway.test_responses_api import with_exec
from tests.gateway_util import Gateway, MockEngine, auth, gateway, ready, spec
from tests.pg import PgCluster

M = "m1"


class Engine(MockEngine):
    """The mock engine, its non-streamed answers ending as llama.cpp's do."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        answer = await super().handle(request)
        if answer.headers.get("content-type") != "application/json":
            return answer
        data = json.loads(answer.content)
        for choice in data.get("choices") or []:
            choice["finish_reason"] = "stop"
        return httpx.Response(200, json=data)


def serve(store_url: str, **app_args: Any) -> Any:
    replicas = [ready("r1", M, "http://e1:1")]
    return gateway(store_url, replicas, [spec(M)], Engine(), **app_args)


async def create(gw: Gateway, key: str, **fields: Any) -> httpx.Response:
    body = {"model": M, "input": "hi", "max_output_tokens": 4, **fields}
    return await gw.http.post("/v1/responses", json=body, headers=auth(key))


def error_of(answer: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = answer.json()["error"]
    return error


def rows(store: Store, key_id: int) -> int:
    with store.session() as session:
        return int(
            session.exec(
                select(func.count()).where(
                    ResponseRecord.key_id == key_id,
                    ResponseRecord.deleted_at == None,  # noqa: E711
                )
            ).one()
        )


def run_headers(gw: Gateway, key_id: int) -> dict[str, str]:
    """The executor's headers for the key (test_responses_api's: it reads only the store)."""
    return with_exec(cast(Any, gw), key_id)


def edit(store: Store, response_id: str, **values: Any) -> None:
    with store.session() as session:
        record = session.get(ResponseRecord, response_id)
        assert record is not None
        for name, value in values.items():
            setattr(record, name, value)
        session.add(record)
        session.commit()


async def test_a_background_response_takes_its_quota_at_creation(store_url: str) -> None:
    """A key of one request a minute creates one background response a
    minute (the next is a 429, nothing stored), and the run of the one it
    created is not refused: it uses the quota taken at creation."""
    async with serve(store_url) as gw:
        key_id, key = gw.key(rpm=1)
        first = await create(gw, key, background=True)
        assert first.status_code == 200, first.text
        second = await create(gw, key, background=True)
        assert second.status_code == 429, second.text
        assert error_of(second)["code"] == "rate_limit_exceeded"
        assert rows(gw.store, key_id) == 1
        response_id = first.json()["id"]
        run = await gw.http.post(
            f"/internal/responses/{response_id}/run", headers=run_headers(gw, key_id)
        )
        assert run.status_code == 200
        assert "response.completed" in run.text or "response.incomplete" in run.text, run.text
        record = rstore.get_response(gw.store, key_id, response_id)
        assert record is not None and record.status in ("completed", "incomplete")
        # Still one request this minute: a chat request is refused.
        chat = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        again = await gw.http.post("/v1/chat/completions", json=chat, headers=auth(key))
        assert again.status_code == 429, again.text


async def test_what_a_response_stores_is_bounded_counting_its_chain(store_url: str) -> None:
    """A response whose input, or whose chain with it, is more than the bound
    is refused with a 400 before anything is generated or stored."""
    bounds = ResponseBounds(max_response_bytes=6000, max_key_response_bytes=10**9)
    async with serve(store_url, response_bounds=bounds) as gw:
        key_id, key = gw.key()
        big = await create(gw, key, input="x" * 7000)
        assert big.status_code == 400, big.text
        assert error_of(big)["code"] == "response_too_large"
        assert rows(gw.store, key_id) == 0 and not gw.engine.seen
        previous, made = None, 0
        while True:
            answer = await create(gw, key, input="y" * 1000, previous_response_id=previous)
            if answer.status_code != 200:
                break
            previous, made = answer.json()["id"], made + 1
            assert made < 10, "the chain grew past its bound"
        assert answer.status_code == 400, answer.text
        assert error_of(answer)["code"] == "response_too_large"
        assert made >= 2 and rows(gw.store, key_id) == made
        assert len(gw.engine.seen) == made
        # Loading the chain stops at the bound: the router holds no more of it.
        assert previous is not None
        with pytest.raises(ChainTooLarge):
            load_chain(gw.store, key_id, previous, max_bytes=1500, deadline=time.monotonic() + 30)


async def test_a_keys_stored_responses_are_bounded(store_url: str) -> None:
    """Past what one key's responses may hold, a stored response (foreground
    or background) is refused with a 400; one with store false is not; a
    deleted response frees its room."""
    bounds = ResponseBounds(max_response_bytes=10**6, max_key_response_bytes=30_000)
    async with serve(store_url, response_bounds=bounds) as gw:
        key_id, key = gw.key()
        made: list[str] = []
        while (answer := await create(gw, key, input="z" * 3000)).status_code == 200:
            made.append(answer.json()["id"])
            assert len(made) < 10, "the key's responses grew past their bound"
        assert answer.status_code == 400, answer.text
        assert error_of(answer)["code"] == "response_storage_full"
        refused = await create(gw, key, input="z" * 3000, background=True)
        assert error_of(refused)["code"] == "response_storage_full"
        assert rows(gw.store, key_id) == len(made) >= 2
        unstored = await create(gw, key, input="z" * 3000, store=False)
        assert unstored.status_code == 200, unstored.text
        # Another key has its own room.
        _, other = gw.key()
        assert (await create(gw, other, input="z" * 3000)).status_code == 200
        deleted = await gw.http.delete(f"/v1/responses/{made[0]}", headers=auth(key))
        assert deleted.status_code == 200
        assert (await create(gw, key, input="z" * 3000, background=True)).status_code == 200


async def test_a_failed_response_cannot_be_continued(store_url: str) -> None:
    """previous_response_id naming a failed response is a 400 (OpenAI
    refuses it too); a cancelled or incomplete one can be continued."""
    async with serve(store_url) as gw:
        key_id, key = gw.key()
        ids = []
        for status in ("failed", "cancelled", "incomplete"):
            made = await create(gw, key, background=True)
            ids.append(made.json()["id"])
            edit(gw.store, ids[-1], status=status)
        refused = await create(gw, key, previous_response_id=ids[0])
        assert refused.status_code == 400, refused.text
        error = error_of(refused)
        assert error["code"] == "previous_response_failed"
        assert error["param"] == "previous_response_id"
        for ok in ids[1:]:
            answer = await create(gw, key, previous_response_id=ok)
            assert answer.status_code == 200, answer.text
        # A chain through a response that failed later cannot be continued either.
        middle = await create(gw, key, previous_response_id=ids[1])
        edit(gw.store, ids[1], status="failed")
        with pytest.raises(PreviousFailed):
            load_chain(
                gw.store,
                key_id,
                middle.json()["id"],
                max_bytes=10**6,
                deadline=time.monotonic() + 30,
            )


@pytest.mark.parametrize("past", ["attempts", "deadline"])
async def test_a_run_past_its_attempts_or_deadline_ends_failed(store_url: str, past: str) -> None:
    """A background run that keeps being retried (a 429 that never clears)
    or runs past its deadline is not generated again: the response ends
    failed, its stream with response.failed, and the executor is told so."""
    async with serve(store_url) as gw:
        key_id, key = gw.key()
        made = await create(gw, key, background=True)
        response_id = made.json()["id"]
        if past == "attempts":
            edit(gw.store, response_id, run_attempts=MAX_RUN_ATTEMPTS)
        else:
            edit(gw.store, response_id, created_at=int(time.time()) - RUN_DEADLINE_S - 60)
        run = await gw.http.post(
            f"/internal/responses/{response_id}/run", headers=run_headers(gw, key_id)
        )
        assert run.status_code == 200
        assert run.json() == {"id": response_id, "status": "failed"}
        assert not gw.engine.seen
        got = await gw.http.get(f"/v1/responses/{response_id}", headers=auth(key))
        assert got.json()["status"] == "failed"
        assert got.json()["error"]["code"] == "server_error"
        events = rstore.events_after(gw.store, response_id, -1)
        assert events[-1]["type"] == "response.failed"


def test_run_refusal_counts_attempts_and_the_deadline() -> None:
    now = 10_000_000.0
    assert run_refusal(1, int(now), now) is None
    assert run_refusal(MAX_RUN_ATTEMPTS, int(now) - RUN_DEADLINE_S, now) is None
    assert run_refusal(MAX_RUN_ATTEMPTS + 1, int(now), now) is not None
    assert run_refusal(1, int(now) - RUN_DEADLINE_S - 1, now) is not None


async def test_a_stalled_store_answers_responses_with_503(pg_cluster: PgCluster) -> None:
    """Responses' store calls held by a lock past the router's bound are a
    503 ``store_unavailable`` in the OpenAI format, not a 500; and the
    chain's load gives up with the request: no query of it is left waiting
    on the lock (a router thread blocked behind the answer)."""
    store_url = pg_cluster.create_database()
    async with serve(store_url, store_wait_s=1.0) as gw:
        _, key = gw.key()
        previous = (await create(gw, key, background=True)).json()["id"]
        with psycopg.connect(store_url) as holder:
            holder.execute("LOCK TABLE openai_responses IN ACCESS EXCLUSIVE MODE")
            try:
                answer = await create(gw, key, previous_response_id=previous)
                assert answer.status_code == 503, answer.text
                assert error_of(answer)["code"] == "store_unavailable"
                async with asyncio.timeout(20):
                    while waiting(store_url, "%openai_respon%"):
                        await asyncio.sleep(0.05)
                for call in (
                    gw.http.get(f"/v1/responses/{previous}", headers=auth(key)),
                    gw.http.get(f"/v1/responses/{previous}/input_items", headers=auth(key)),
                    gw.http.post(f"/v1/responses/{previous}/cancel", headers=auth(key)),
                    gw.http.delete(f"/v1/responses/{previous}", headers=auth(key)),
                ):
                    answer = await call
                    assert answer.status_code == 503, answer.text
                    assert error_of(answer)["code"] == "store_unavailable"
            finally:
                holder.rollback()


async def test_a_response_its_workflow_gave_up_on_ends_failed_when_read(store_url: str) -> None:
    """A background response still queued past the workflow's execution
    timeout (no router was reached: no run will end it) is failed by the
    first read: GET says failed, and its stream ends with response.failed
    instead of following it forever."""
    async with serve(store_url) as gw:
        _, key = gw.key()
        streamed = (await create(gw, key, background=True)).json()["id"]
        got = (await create(gw, key, background=True)).json()["id"]
        for response_id in (streamed, got):
            edit(gw.store, response_id, created_at=int(time.time()) - ABANDONED_AFTER_S - 60)
        async with asyncio.timeout(30):
            stream = await gw.http.get(
                f"/v1/responses/{streamed}", params={"stream": "true"}, headers=auth(key)
            )
        assert stream.status_code == 200
        assert "event: response.failed" in stream.text, stream.text
        answer = await gw.http.get(f"/v1/responses/{got}", headers=auth(key))
        assert answer.json()["status"] == "failed", answer.text
        assert answer.json()["error"]["code"] == "server_error"
        assert not gw.engine.seen
