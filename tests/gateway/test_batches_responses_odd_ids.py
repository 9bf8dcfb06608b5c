"""``/v1/batches`` and ``/v1/responses`` with ids neither can have (control
characters, a NUL), on SQLite and on a real PostgreSQL: each answered as an
unknown id is (a 404 ``No batch found`` / ``Response ... not found``; a
``previous_response_id`` of that kind the 400 ``previous_response_not_found``;
a batch cursor ``after`` of that kind an empty page, as an unknown id's), and
the real batch and response are untouched. PostgreSQL refuses a NUL in a
text parameter with an error: before the ids' shape was checked, each with a
NUL answered 503 ``store_unavailable`` there, as if the store were down. The
router app served by uvicorn, called over HTTP (httpx: the openai client
quotes ids itself)."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import unquote

import httpx
import uvicorn

from llmgw.store import Store, files
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from tests.gateway.test_batches_api import jsonl, line
from tests.gateway_util import FakeSource, MockEngine, MockUpstream, ready, spec
from tests.harness import free_port

M = "m"
BATCH_IDS = ["%00", "batch_%00abc", "%01%02%1f%7f", "batch_a%0Ab", "batch_x-y"]
RESPONSE_IDS = ["%00", "resp_%00abc", "%01%02%1f%7f", "resp_a%0Ab", "resp_x-y"]


@asynccontextmanager
async def serve(store_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, Store, int]]:
    """The router over ``store_url`` (a mock engine serving ``M``), a client
    to it with a new key's credential, the store and the key's id."""
    store = Store(store_url)
    store.migrate()
    store.put_model(spec(M))
    app = create_app(
        store, FakeSource([ready("r1", M, "http://engine:1")]), http=MockUpstream(MockEngine()),
        refresh_interval_s=0.05, usage_flush_interval_s=0.05, store_wait_s=10.0,
    )  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    info, key = create_key(store, "k", KeyPolicy())
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as http:
            async with asyncio.timeout(60):
                while not server.started:
                    await asyncio.sleep(0.02)
                while not (await http.get("/healthz")).json()["routing_table_loaded"]:
                    await asyncio.sleep(0.02)
            yield http, store, info.id
    finally:
        server.should_exit = True
        await task
        store.close()


async def test_batch_ids_no_batch_can_have_are_404_on_every_store(store_url: str) -> None:
    async with serve(store_url) as (http, store, key_id):
        file_id = files.write_file(
            store, key_id, "in.jsonl", "batch", [jsonl(line("a"))], max_bytes=1 << 20
        ).id
        made = await http.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                  "completion_window": "24h"},
        )  # fmt: skip
        assert made.status_code == 200, made.text
        batch_id = made.json()["id"]
        for odd in BATCH_IDS:
            for method, path in (
                ("GET", f"/v1/batches/{odd}"),
                ("POST", f"/v1/batches/{odd}/cancel"),
            ):
                answer = await http.request(method, path)
                assert answer.status_code == 404, (method, path, answer.text)
                assert answer.json()["error"]["message"].startswith("No batch found")
            listed = await http.get(f"/v1/batches?after={odd}")
            assert listed.status_code == 200, (odd, listed.text)
            assert listed.json()["data"] == []
        # The real batch is untouched, still listed and served.
        everything = await http.get("/v1/batches")
        assert [b["id"] for b in everything.json()["data"]] == [batch_id]
        again = await http.get(f"/v1/batches/{batch_id}")
        assert again.status_code == 200 and again.json()["status"] == "validating"


async def test_response_ids_no_response_can_have_are_not_found_on_every_store(
    store_url: str,
) -> None:
    async with serve(store_url) as (http, _, _):
        # A background one: stored as it is created (no executor runs it here).
        made = await http.post(
            "/v1/responses", json={"model": M, "input": "hi", "background": True}
        )
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        for odd in RESPONSE_IDS:
            for method, path in (
                ("GET", f"/v1/responses/{odd}"),
                ("GET", f"/v1/responses/{odd}/input_items"),
                ("POST", f"/v1/responses/{odd}/cancel"),
                ("DELETE", f"/v1/responses/{odd}"),
            ):
                answer = await http.request(method, path)
                assert answer.status_code == 404, (method, path, answer.text)
                assert answer.json()["error"]["message"].startswith("Response with id")
            following = await http.post(
                "/v1/responses",
                json={"model": M, "input": "hi", "previous_response_id": unquote(odd)},
            )
            assert following.status_code == 400, (odd, following.text)
            assert following.json()["error"]["code"] == "previous_response_not_found"
        items = await http.get(f"/v1/responses/{response_id}/input_items?after=%00")
        assert items.status_code == 200 and items.json()["data"] == [], items.text
        # The real response is untouched and still served.
        again = await http.get(f"/v1/responses/{response_id}")
        assert again.status_code == 200 and again.json()["status"] == "queued", again.text
