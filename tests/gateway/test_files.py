"""``/v1/files`` through the official openai client against the router app
served by uvicorn, on SQLite and on a real PostgreSQL: upload, wait for
processing, list (pages with after/limit), retrieve, content, delete; the size
bound (413, nothing left in the store); another key's file (404); a purpose
other than batch (400); and an upload written to the store while it is still
arriving (never held whole)."""

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from sqlmodel import func, select

from llmgw.store import Store
from llmgw.store.openai_tables import FILE_CHUNK_BYTES, FileChunk, StoredFile
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from tests.gateway_util import FakeSource
from tests.harness import free_port

K = FILE_CHUNK_BYTES


@dataclass
class Router:
    base: str
    store: Store

    def key(self) -> str:
        return create_key(self.store, "k", KeyPolicy())[1]

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0)

    def rows(self) -> tuple[int, int]:
        """File rows and chunk rows in the store."""
        with self.store.session() as session:
            files = session.exec(select(func.count()).select_from(StoredFile)).one()
            chunks = session.exec(select(func.count()).select_from(FileChunk)).one()
        return files, chunks


async def until(check: Callable[[], bool], timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


@asynccontextmanager
async def router(store_url: str, **app_args: Any) -> AsyncIterator[Router]:
    store = Store(store_url)
    store.migrate()
    # An upload's every chunk write is bounded too: 10 s, as tests/gateway_util.py
    # gives, for a loaded machine (the bound is tested in test_files_store_frozen.py).
    app_args.setdefault("store_wait_s", 10.0)
    app = create_app(store, FakeSource([]), refresh_interval_s=0.05, **app_args)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started)
        yield Router(f"http://127.0.0.1:{port}", store)
    finally:
        server.should_exit = True
        await task
        store.close()


def jsonl(n: int, pad: int = 0) -> bytes:
    return b"".join(b'{"custom_id":"r%d","pad":"%s"}\n' % (i, b"x" * pad) for i in range(n))


async def test_upload_list_retrieve_content_and_delete(store_url: str) -> None:
    async with router(store_url) as r, r.client(r.key()) as client:
        # Larger than two chunks, so the content crosses chunk boundaries.
        content = jsonl(300, pad=9000)
        assert len(content) > 2 * K
        made = await client.files.create(file=("in.jsonl", content), purpose="batch")
        assert made.id.startswith("file-") and made.object == "file"
        assert (made.bytes, made.filename, made.purpose) == (len(content), "in.jsonl", "batch")
        assert made.status == "processed" and made.expires_at is None
        done = await client.files.wait_for_processing(made.id, poll_interval=0.05)
        assert done == made
        assert await client.files.retrieve(made.id) == made
        body = await client.files.content(made.id)
        assert body.read() == content
        listed = await client.files.list()
        assert [f.id for f in listed.data] == [made.id]
        assert (await client.files.list(purpose="batch_output")).data == []

        gone = await client.files.delete(made.id)
        assert (gone.id, gone.object, gone.deleted) == (made.id, "file", True)
        for call in (client.files.retrieve, client.files.content, client.files.delete):
            with pytest.raises(openai.NotFoundError) as caught:
                await call(made.id)
            assert caught.value.body == {
                "message": f"No such File object: {made.id}",
                "type": "invalid_request_error",
                "param": "id",
                "code": None,
            }
        assert (await client.files.list()).data == []
        assert r.rows()[1] == 0  # the content went with it

        # expires_after: recorded, and the file is served until then.
        later = await client.files.create(
            file=("e.jsonl", b"{}\n"),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
        assert later.expires_at == later.created_at + 3600


async def test_a_file_past_the_bound_is_refused_and_nothing_is_stored(store_url: str) -> None:
    # The bound falls after the first chunk: something was written, then removed.
    async with router(store_url, max_file_bytes=K + K // 2) as r, r.client(r.key()) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("big.jsonl", jsonl(300, pad=9000)), purpose="batch")
        assert caught.value.status_code == 413
        assert caught.value.code == "file_too_large" and caught.value.param == "file"
        assert str(K + K // 2) in caught.value.message
        assert r.rows() == (0, 0)
        assert (await client.files.list()).data == []
        # Just under the bound is taken.
        ok = await client.files.create(file=("ok.jsonl", b"x" * (K + K // 2)), purpose="batch")
        assert ok.bytes == K + K // 2


async def test_a_keys_files_are_bounded_in_all(store_url: str) -> None:
    total = 2 * K
    async with router(store_url, max_key_file_bytes=total) as r:
        mine, theirs = r.key(), r.key()
        async with r.client(mine) as client, r.client(theirs) as other:
            first = await client.files.create(file=("a.jsonl", b"x" * K), purpose="batch")
            before = r.rows()
            with pytest.raises(openai.APIStatusError) as caught:
                await client.files.create(file=("b.jsonl", b"x" * (K + 1)), purpose="batch")
            assert caught.value.status_code == 413
            assert caught.value.code == "file_storage_full" and caught.value.param == "file"
            assert str(total) in caught.value.message and str(K) in caught.value.message
            assert r.rows() == before  # nothing of it kept
            # Another key has its own room; deleting makes room again.
            await other.files.create(file=("c.jsonl", b"x" * (K + 1)), purpose="batch")
            await client.files.delete(first.id)
            again = await client.files.create(file=("b.jsonl", b"x" * (K + 1)), purpose="batch")
            assert again.bytes == K + 1


async def test_another_keys_file_is_not_found(store_url: str) -> None:
    async with router(store_url) as r, r.client(r.key()) as mine, r.client(r.key()) as theirs:
        made = await mine.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
        for call in (theirs.files.retrieve, theirs.files.content, theirs.files.delete):
            with pytest.raises(openai.NotFoundError):
                await call(made.id)
        assert (await theirs.files.list()).data == []
        assert (await mine.files.content(made.id)).read() == b"{}\n"  # still there


async def test_pages_with_after_and_limit(store_url: str) -> None:
    async with router(store_url) as r, r.client(r.key()) as client:
        ids = {
            (await client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch")).id
            for i in range(5)
        }
        first = await client.files.list(limit=2)
        assert len(first.data) == 2 and first.has_more
        second = await client.files.list(limit=2, after=first.data[-1].id)
        assert len(second.data) == 2 and second.has_more
        assert not {f.id for f in first.data} & {f.id for f in second.data}
        # The client's auto-paging sends after=<last id> until has_more is false.
        for order in ("asc", "desc"):
            seen = [f.id async for f in client.files.list(limit=2, order=order)]
            assert len(seen) == 5 and set(seen) == ids
        newest_first = [(f.created_at, f.id) for f in (await client.files.list()).data]
        assert newest_first == sorted(newest_first, reverse=True)


async def test_only_purpose_batch_and_a_multipart_body(store_url: str) -> None:
    async with router(store_url) as r, r.client(r.key()) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
        assert caught.value.param == "purpose" and "'batch'" in caught.value.message
        async with httpx.AsyncClient(base_url=r.base) as http:
            auth = {"Authorization": f"Bearer {client.api_key}"}
            no_file = await http.post("/v1/files", data={"purpose": "batch"}, headers=auth)
            assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
            not_multipart = await http.post("/v1/files", json={"purpose": "batch"}, headers=auth)
            assert not_multipart.status_code == 400
            unkeyed = await http.post("/v1/files", files={"file": b"{}"}, data={"purpose": "batch"})
            assert unkeyed.status_code == 401
        assert r.rows() == (0, 0)


async def test_an_upload_is_stored_while_it_arrives(store_url: str) -> None:
    """The body is sent in pieces; half-way, the store already holds chunks
    of it: the router wrote them before the body ended (a router holding the
    whole body first would write nothing until the end, and this would time
    out)."""
    async with router(store_url) as r:
        key = r.key()
        boundary = "llmgwtestboundary"
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="s.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        piece = jsonl(10, pad=6500)  # ~65 KiB

        async def body() -> AsyncIterator[bytes]:
            yield head
            sent = 0
            while sent < 3 * K:
                yield piece
                sent += len(piece)
            await until(lambda: r.rows()[1] >= 2)
            yield piece
            yield f"\r\n--{boundary}--\r\n".encode()

        async with httpx.AsyncClient(base_url=r.base, timeout=60) as http:
            answer = await http.post(
                "/v1/files",
                content=body(),
                headers={
                    "Authorization": f"Bearer {key}",
                    "Content-Type": f"multipart/form-data; boundary={boundary}",
                },
            )
        assert answer.status_code == 200, answer.text
        size = answer.json()["bytes"]
        assert size % len(piece) == 0 and size > 3 * K
        async with r.client(key) as client:
            content = (await client.files.content(answer.json()["id"])).read()
        assert content == piece * (size // len(piece))
