"""``/v1/batches`` through the official openai client against the router app
served by uvicorn (the engine scripted: no line runs here, the control
worker runs them), with an injected Jobs recording the starts and cancels:
create, retrieve, list pages, cancel, another key's ids, a finished batch's
cancel. And the executor's ``POST /internal/batches/{id}/validate``: every
kind of bad line reported with its line number, code and param; a good
file's lines stored once however often it is validated."""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
import uvicorn
from sqlmodel import col, select

from llmgw.engine_keys import exec_token
from llmgw.store import Store, files
from llmgw.store.openai_tables import BatchLine, BatchRecord
from router.api.apikeys import create_key
from router.app import create_app
from router.batches import validate as batch_validate
from router.billing.key_policy import KeyPolicy
from tests.gateway_util import FakeSource, MockEngine, MockUpstream, ready, spec
from tests.harness import free_port

M = "m"
CHAT: Literal["/v1/chat/completions"] = "/v1/chat/completions"


@dataclass
class FakeJobs:
    """The executor link, as the router calls it (contract §5)."""

    started: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def start_batch(self, batch_id: str) -> None:
        self.started.append(batch_id)

    def cancel_batch(self, batch_id: str) -> None:
        self.cancelled.append(batch_id)

    def start_response(self, response_id: str) -> None:
        pass

    def cancel_response(self, response_id: str) -> None:
        pass


@dataclass
class Router:
    base: str
    store: Store
    jobs: FakeJobs

    def key(self, **policy: Any) -> tuple[str, int]:
        info, key = create_key(self.store, "k", KeyPolicy(**policy))
        return key, info.id

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0)

    def file(self, key_id: int, content: bytes, purpose: str = "batch", piece: int = 0) -> str:
        """An uploaded file (``piece``: written in pieces that short, so
        lines span the store's chunks)."""
        parts = (
            [content[i : i + piece] for i in range(0, len(content), piece)] if piece else [content]
        )
        stored = files.write_file(self.store, key_id, "in.jsonl", purpose, parts, max_bytes=1 << 24)
        return stored.id

    def exec_headers(self, key_id: int) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {exec_token(self.store.engine_key_secret(), key_id)}",
            "X-Llmgw-Key-Id": str(key_id),
        }


@asynccontextmanager
async def router(tmp_path: Path) -> AsyncIterator[Router]:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    store.put_model(spec(M))
    store.put_model(spec("other"))
    app = create_app(
        store, FakeSource([ready("r1", M, "http://engine:1")]), http=MockUpstream(MockEngine()),
        refresh_interval_s=0.05, usage_flush_interval_s=0.05,
    )  # fmt: skip
    jobs = FakeJobs()
    app.state.jobs = jobs
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(60), httpx.AsyncClient() as http:
            while not server.started:
                await asyncio.sleep(0.02)
            while not (await http.get(f"{base}/healthz")).json()["routing_table_loaded"]:
                await asyncio.sleep(0.02)
        yield Router(base, store, jobs)
    finally:
        server.should_exit = True
        await task
        store.close()


def line(custom_id: str, url: str = CHAT, **body: Any) -> dict[str, Any]:
    body = body or {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(*lines: dict[str, Any] | str) -> bytes:
    return b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)


async def test_create_retrieve_cancel_and_the_batch_object(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key()
        file_id = r.file(key_id, jsonl(line("a"), line("b")))
        async with r.client(key) as client:
            batch = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                metadata={"job": "nightly"},
            )  # fmt: skip
            assert batch.id.startswith("batch_") and batch.object == "batch"
            assert (batch.status, batch.endpoint, batch.input_file_id) == (
                "validating", CHAT, file_id,
            )  # fmt: skip
            assert batch.expires_at == batch.created_at + 24 * 3600
            assert batch.metadata == {"job": "nightly"} and batch.completion_window == "24h"
            assert batch.request_counts is not None and batch.request_counts.total == 0
            assert batch.errors is None and batch.output_file_id is None
            assert r.jobs.started == [batch.id]
            # Strictly what the client's types say, nothing missing or extra.
            raw = await client.batches.with_raw_response.retrieve(batch.id)
            got = json.loads(raw.content)
            assert set(got) == set(type(batch).model_fields)
            assert type(batch).model_validate(got, strict=True).id == batch.id
            assert got["in_progress_at"] is None and got["cancelled_at"] is None
            cancelled = await client.batches.cancel(batch.id)
            assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
            assert r.jobs.cancelled == [batch.id]
            # A second cancel answers it unchanged and signals nothing more.
            again = await client.batches.cancel(batch.id)
            assert (again.status, again.cancelling_at) == ("cancelling", cancelled.cancelling_at)
            assert r.jobs.cancelled == [batch.id]
            assert (await client.batches.retrieve(batch.id)).status == "cancelling"


async def test_cancelling_a_finished_batch_is_refused(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key()
        file_id = r.file(key_id, jsonl(line("a")))
        async with r.client(key) as client:
            batch = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            with r.store.session() as session:
                record = session.get(BatchRecord, batch.id)
                assert record is not None
                record.status, record.completed_at = "completed", record.created_at + 5
                session.add(record)
                session.commit()
            with pytest.raises(openai.BadRequestError) as refused:
                await client.batches.cancel(batch.id)
            assert refused.value.body == {
                "message": "Cannot cancel a batch with status 'completed'.",
                "type": "invalid_request_error", "param": None, "code": None,
            }  # fmt: skip
            assert r.jobs.cancelled == []
            assert (await client.batches.retrieve(batch.id)).status == "completed"


async def test_list_pages_newest_first(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key()
        other, _ = r.key()
        file_id = r.file(key_id, jsonl(line("a")))
        async with r.client(key) as client, r.client(other) as stranger:
            made = [
                (
                    await client.batches.create(
                        input_file_id=file_id, endpoint=CHAT, completion_window="24h"
                    )
                ).id
                for _ in range(5)
            ]
            page = await client.batches.list(limit=2)
            assert page.has_more and len(page.data) == 2
            listed = [b.id async for b in await client.batches.list(limit=2)]
            assert sorted(listed) == sorted(made) and len(listed) == 5
            # Newest first: creation time descending (ids break ties).
            stamps = [(b.created_at, b.id) async for b in await client.batches.list(limit=2)]
            assert stamps == sorted(stamps, reverse=True)
            raw = await client.batches.with_raw_response.list(limit=3)
            body = json.loads(raw.content)
            assert body["object"] == "list" and body["has_more"] is True
            assert (body["first_id"], body["last_id"]) == (
                body["data"][0]["id"], body["data"][-1]["id"],
            )  # fmt: skip
            rest = await client.batches.list(limit=3, after=body["last_id"])
            assert len(rest.data) == 2 and not rest.has_more
            assert (await stranger.batches.list()).data == []


async def test_another_keys_batch_and_file_are_not_found(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key()
        other, other_id = r.key()
        mine = r.file(key_id, jsonl(line("a")))
        theirs = r.file(other_id, jsonl(line("a")))
        output = r.file(key_id, jsonl(line("a")), purpose="batch_output")
        async with r.client(key) as client, r.client(other) as stranger:
            batch = await client.batches.create(
                input_file_id=mine, endpoint=CHAT, completion_window="24h"
            )
            for call in (
                stranger.batches.retrieve(batch.id),
                stranger.batches.cancel(batch.id),
                client.batches.retrieve("batch_nope"),
            ):
                with pytest.raises(openai.NotFoundError) as missing:
                    await call
                assert missing.value.body["message"].startswith("No batch found with id")  # type: ignore[index]
            assert (await client.batches.retrieve(batch.id)).status == "validating"
            with pytest.raises(openai.NotFoundError) as no_file:
                await client.batches.create(
                    input_file_id=theirs, endpoint=CHAT, completion_window="24h"
                )
            assert no_file.value.body["param"] == "input_file_id"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as purpose:
                await client.batches.create(
                    input_file_id=output, endpoint=CHAT, completion_window="24h"
                )
            assert purpose.value.body["code"] == "invalid_file_purpose"  # type: ignore[index]
            for bad, param in (
                ({"endpoint": "/v1/moderations"}, "endpoint"),
                ({"completion_window": "1h"}, "completion_window"),
                ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
            ):
                args: dict[str, Any] = {
                    "input_file_id": mine, "endpoint": CHAT, "completion_window": "24h", **bad,
                }  # fmt: skip
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.batches.create(**args)
                assert refused.value.body["param"] == param  # type: ignore[index]
            assert len(r.jobs.started) == 1


def _lines_of(store: Store, batch_id: str) -> list[tuple[int, str]]:
    with store.session() as session:
        rows = session.exec(
            select(BatchLine).where(BatchLine.batch_id == batch_id).order_by(col(BatchLine.line))
        ).all()
        return [(row.line, row.custom_id) for row in rows]


async def _validate(r: Router, http: httpx.AsyncClient, batch_id: str, key_id: int) -> Any:
    answer = await http.post(
        f"{r.base}/internal/batches/{batch_id}/validate", headers=r.exec_headers(key_id)
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_validation_reports_each_bad_line(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key(models=[M, "gone"])
        content = jsonl(
            line("ok-1"),                                                   # 1
            "{not json",                                                    # 2
            json.dumps({"method": "POST", "url": CHAT, "body": {}}),        # 3
            line("ok-1"),                                                   # 4
            {**line("get"), "method": "GET"},                               # 5
            line("url", url="/v1/embeddings", model=M, input="x"),          # 6
            line("schema", model=M, messages=[]),                           # 7
            line("stream", model=M, messages=[{"role": "user"}], stream=True),  # 8
            line("notallowed", model="other", messages=[{"role": "user"}]),  # 9
            "",                                                             # 10 (blank)
            line("unknown", model="gone", messages=[{"role": "user"}]),     # 11
            "[1, 2]",                                                       # 12
        )  # fmt: skip
        file_id = r.file(key_id, content, piece=7)
        async with r.client(key) as client, httpx.AsyncClient() as http:
            batch = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            result = await _validate(r, http, batch.id, key_id)
            assert result["total"] == 11
            got = [(e["line"], e["code"], e["param"]) for e in result["errors"]]
            assert got == [
                (2, "invalid_json_line", None),
                (3, "missing_custom_id", "custom_id"),
                (4, "duplicate_custom_id", "custom_id"),
                (5, "invalid_method", "method"),
                (6, "mismatched_url", "url"),
                (7, "invalid_request_body", "body.messages"),
                (8, "invalid_request_body", "body.stream"),
                (9, "model_not_allowed", "body.model"),
                (11, "model_not_found", "body.model"),
                (12, "invalid_json_line", None),
            ]
            assert all(e["message"] for e in result["errors"])
            assert "line 1" in result["errors"][2]["message"]  # where the first use is
            assert _lines_of(r.store, batch.id) == []  # a bad file runs no line
            assert (await client.batches.retrieve(batch.id)).request_counts.total == 11  # type: ignore[union-attr]
            # Without the exec token: refused, whoever asks.
            own = await http.post(
                f"{r.base}/internal/batches/{batch.id}/validate",
                headers={"Authorization": f"Bearer {key}"},
            )
            assert own.status_code == 401


async def test_a_good_file_is_stored_once_however_often_validated(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key()
        n = batch_validate.WRITE_CHUNK + 5  # two write transactions
        content = jsonl(*(line(f"c{i}") for i in range(n)))
        file_id = r.file(key_id, content.rstrip(b"\n"), piece=4096)  # no final newline
        responses = r.file(
            key_id,
            jsonl(
                line("r1", url="/v1/responses", model=M, input="hi", max_output_tokens=4),
                line("r2", url="/v1/responses", model=M, input=[{"role": "user", "content": 3}]),
                line("r3", url="/v1/responses", model=M, input="hi", background=True),
            ),
        )
        async with r.client(key) as client, httpx.AsyncClient() as http:
            batch = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            for _ in range(2):
                result = await _validate(r, http, batch.id, key_id)
                assert result == {"total": n, "errors": []}
                stored = _lines_of(r.store, batch.id)
                assert stored == [(i + 1, f"c{i}") for i in range(n)]
            # /v1/responses lines go through the Responses request's own check.
            other = await client.batches.create(
                input_file_id=responses, endpoint="/v1/responses", completion_window="24h"
            )
            result = await _validate(r, http, other.id, key_id)
            got = [(e["line"], e["code"], e["param"]) for e in result["errors"]]
            assert got == [
                (2, "invalid_request_body", "body.input"),
                (3, "invalid_request_body", "body.background"),
            ]


async def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key()
        file_id = r.file(key_id, b"\n\n")
        async with r.client(key) as client, httpx.AsyncClient() as http:
            batch = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            result = await _validate(r, http, batch.id, key_id)
            assert result["total"] == 0
            assert [(e["code"], e["line"]) for e in result["errors"]] == [("empty_file", None)]
