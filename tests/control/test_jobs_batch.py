"""The Batch workflow and its activities on a real Temporal dev server, with
a fake router (a small ASGI app served by uvicorn on loopback) answering the
internal validate endpoint and the chat endpoint as a router would: the
executor's side of the contract, without engines."""

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from sqlmodel import select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from activities.control.jobs import JobActivities
from activities.control.router_client import RouterClient
from llmgw import contracts
from llmgw.engine_keys import exec_token
from llmgw.queues import batch_workflow_id
from llmgw.store import Store
from llmgw.store.files import read_chunks
from llmgw.store.openai_tables import BatchLine, BatchRecord, BatchResult
from llmgw.types import BatchId, BatchRun, BatchStatus, CancelJob, ChunkRange
from router.billing import usage
from tests.harness import free_port
from workflows.jobs_batch import BatchWorkflow
from workflows.jobs_response import BackgroundResponseWorkflow

KEY_ID = 7
PROMPT, COMPLETION = 5, 7


@dataclass
class FakeRouter:
    """Answers like a router: validate writes the lines; each chat line is
    answered at once unless held (``hold``: a custom_id -> its gate); the
    first ``busy`` requests get 503 queue_full."""

    store: Store
    token: str
    lines: list[str]
    busy: int = 0
    hold: dict[str, asyncio.Event] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    refused: int = 0
    arrived: dict[str, asyncio.Event] = field(default_factory=dict)
    # Background responses: 503 to the first ``run_busy`` runs; a run whose
    # id is in ``hold`` streams one event and waits there.
    run_busy: int = 0
    runs: list[str] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/internal/batches/{batch_id}/validate", self.validate, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/internal/responses/{response_id}/run", self.run, methods=["POST"]),
            ]
        )

    def _authorised(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.token}"

    async def validate(self, request: Request) -> JSONResponse:
        if not self._authorised(request) or request.headers.get("x-llmgw-key-id") != str(KEY_ID):
            return JSONResponse({"error": {"code": "invalid_api_key"}}, 401)
        batch_id = request.path_params["batch_id"]
        with self.store.session() as session:
            for row in session.exec(select(BatchLine).where(BatchLine.batch_id == batch_id)):
                session.delete(row)
            for i, custom_id in enumerate(self.lines, start=1):
                body = {"model": "m1", "messages": [{"role": "user", "content": custom_id}]}
                session.add(BatchLine(batch_id=batch_id, line=i, custom_id=custom_id, body=body))
            batch = session.get(BatchRecord, batch_id)
            assert batch is not None
            batch.total = len(self.lines)
            session.add(batch)
            session.commit()
        return JSONResponse({"total": len(self.lines), "errors": []})

    async def run(self, request: Request) -> Response:
        if not self._authorised(request):
            return JSONResponse({"error": {"code": "invalid_api_key"}}, 401)
        response_id = request.path_params["response_id"]
        self.runs.append(response_id)
        if len(self.runs) <= self.run_busy:
            return JSONResponse({"error": {"code": "engine_error"}}, 502)
        gate = self.hold.get(response_id)

        async def events() -> AsyncIterator[bytes]:
            yield _sse({"type": "response.in_progress", "sequence_number": 1})
            if gate is not None:
                await gate.wait()
            done = {"id": response_id, "status": "completed"}
            yield _sse({"type": "response.completed", "sequence_number": 2, "response": done})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(self, request: Request) -> JSONResponse:
        headers = request.headers
        assert self._authorised(request)
        assert headers["x-llmgw-key-id"] == str(KEY_ID)
        assert headers["x-llmgw-priority"] == "batch"
        assert headers["x-llmgw-billed-by-caller"] == "1"
        custom_id = (await request.json())["messages"][0]["content"]
        self.seen.append(custom_id)
        if self.refused < self.busy:
            self.refused += 1
            return JSONResponse(
                {"error": {"code": "queue_full", "message": "full", "type": "server_error"}},
                503,
                headers={"Retry-After": "0"},
            )
        self.arrived.setdefault(custom_id, asyncio.Event()).set()
        gate = self.hold.get(custom_id)
        if gate is not None:
            await gate.wait()
        return JSONResponse(
            {
                "id": f"chatcmpl-{custom_id}",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION},
            }
        )


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


@contextlib.asynccontextmanager
async def serving(router: FakeRouter) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(router.app(), host="127.0.0.1", port=port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(20):
        while not server.started:
            await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for gate in router.hold.values():
            gate.set()
        server.should_exit = True
        await task


@dataclass
class Rig:
    client: Client
    store: Store
    router: FakeRouter
    queue: str
    stopped: list[tuple[int, int]]
    jobs: JobActivities

    def new_batch(self, expires_in_s: float = 3600) -> tuple[str, float]:
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        expires_at = now + expires_in_s
        with self.store.session() as session:
            session.add(
                BatchRecord(
                    id=batch_id,
                    key_id=KEY_ID,
                    endpoint="/v1/chat/completions",
                    input_file_id="file-x",
                    created_at=now,
                    expires_at=int(expires_at),
                )
            )
            session.commit()
        return batch_id, expires_at

    async def start(
        self, batch_id: str, expires_at: float, **knobs: Any
    ) -> WorkflowHandle[Any, Any]:
        run = BatchRun(batch_id=batch_id, expires_at=expires_at, **knobs)
        return await contracts.BATCH.start(
            self.client, run, id=batch_workflow_id(batch_id), task_queue=self.queue
        )

    def batch(self, batch_id: str) -> BatchRecord:
        with self.store.session() as session:
            row = session.get(BatchRecord, batch_id)
            assert row is not None
            session.expunge(row)
            return row

    def results(self, batch_id: str) -> list[BatchResult]:
        with self.store.session() as session:
            return list(session.exec(select(BatchResult).where(BatchResult.batch_id == batch_id)))

    def file_lines(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        data = b"".join(read_chunks(self.store, file_id))
        return [json.loads(line) for line in data.splitlines()]

    def billed(self) -> tuple[int, int, int]:
        rows = usage.query(self.store, key_id=KEY_ID)
        return (
            sum(r.requests for r in rows),
            sum(r.prompt_tokens for r in rows),
            sum(r.completion_tokens for r in rows),
        )


@contextlib.asynccontextmanager
async def rig(
    client: Client, tmp_path: Path, lines: list[str], **router: Any
) -> AsyncIterator[Rig]:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.migrate()
    fake = FakeRouter(store, exec_token(store.engine_key_secret(), KEY_ID), lines, **router)
    stopped: list[tuple[int, int]] = []

    def on_stopping(chunk: ChunkRange, _: int) -> None:
        stopped.append((chunk.first_line, chunk.last_line))

    async with serving(fake) as url:

        async def secret() -> str:
            return store.engine_key_secret()

        http = RouterClient([f"http://127.0.0.1:{free_port()}", url], secret)  # the first is down
        jobs = JobActivities(store, http, cancel_grace_s=5.0, on_stopping=on_stopping)
        queue = f"exec-test-{uuid.uuid4().hex[:8]}"
        worker = Worker(
            client,
            task_queue=queue,
            workflows=[BatchWorkflow, BackgroundResponseWorkflow],
            activities=[
                jobs.validate_batch, jobs.set_batch_status, jobs.run_chunk,
                jobs.finalize_batch, jobs.run_response,
            ],
        )  # fmt: skip
        async with worker:
            yield Rig(client, store, fake, queue, stopped, jobs)
        await http.aclose()
    store.close()


async def until(cond: Callable[[], bool], timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.05)


async def test_a_batch_runs_every_line_once_and_bills_it_once(
    client: Client, tmp_path: Path
) -> None:
    ids = [f"r{i}" for i in range(1, 11)]
    async with rig(client, tmp_path, ids, busy=3) as r:
        batch_id, expires_at = r.new_batch()
        handle = await r.start(batch_id, expires_at, chunk_lines=3, parallel_chunks=2)
        result = await asyncio.wait_for(handle.result(), 120)
        assert result.status is BatchStatus.COMPLETED
        assert (result.completed, result.failed) == (10, 0)
        batch = r.batch(batch_id)
        assert batch.status == "completed" and batch.completed == 10 and batch.failed == 0
        for at in (batch.in_progress_at, batch.finalizing_at, batch.completed_at):
            assert at is not None
        assert r.router.refused == 3  # the 503s were retried, never a line's failure
        out = r.file_lines(batch.output_file_id)
        assert sorted(line["custom_id"] for line in out) == sorted(ids)
        assert [line["custom_id"] for line in out] == ids  # input order
        assert out[0]["response"]["status_code"] == 200 and out[0]["error"] is None
        assert batch.error_file_id is None
        assert r.billed() == (10, 10 * PROMPT, 10 * COMPLETION)
        memo = await (await handle.describe()).memo()
        assert memo["batch"]["status"] == "completed" and memo["batch"]["completed"] == 10


async def test_a_chunk_run_twice_records_and_bills_each_line_once(
    client: Client, tmp_path: Path
) -> None:
    ids = [f"r{i}" for i in range(1, 7)]
    async with rig(client, tmp_path, ids) as r:
        batch_id, _ = r.new_batch()
        jobs = r.jobs
        await jobs.validate_batch(BatchId(batch_id=batch_id))
        env = ActivityEnvironment()
        chunk = ChunkRange(batch_id=batch_id, first_line=1, last_line=6)
        # Two tries of one chunk at once (a retry while the first still runs):
        # every line is sent by both, recorded and billed by one.
        first, second = await asyncio.gather(
            env.run(jobs.run_chunk, chunk), env.run(jobs.run_chunk, chunk)
        )
        assert first.completed + second.completed == 6
        assert len(r.router.seen) == 12
        # A third try finds every line done and sends nothing.
        third = await env.run(jobs.run_chunk, chunk)
        assert (third.completed, third.skipped) == (0, 6) and len(r.router.seen) == 12
        results = r.results(batch_id)
        assert sorted(x.custom_id for x in results) == sorted(ids)
        assert r.batch(batch_id).completed == 6
        assert r.billed() == (6, 6 * PROMPT, 6 * COMPLETION)


async def test_an_expired_batch_returns_the_lines_that_finished(
    client: Client, tmp_path: Path
) -> None:
    ids = [f"r{i}" for i in range(1, 9)]
    hold = {f"r{i}": asyncio.Event() for i in range(4, 9)}
    async with rig(client, tmp_path, ids, hold=hold) as r:
        batch_id, expires_at = r.new_batch(expires_in_s=4)
        handle = await r.start(
            batch_id, expires_at, chunk_lines=8, parallel_chunks=1, line_concurrency=1
        )
        await until(lambda: "r4" in r.router.arrived)
        # r4 is in flight when the window ends: the chunk stops taking lines
        # and lets it finish.
        await until(lambda: bool(r.stopped))
        hold["r4"].set()
        result = await asyncio.wait_for(handle.result(), 120)
        assert result.status is BatchStatus.EXPIRED
        batch = r.batch(batch_id)
        assert batch.expired_at is not None and batch.completed == 4
        out = r.file_lines(batch.output_file_id)
        assert [line["custom_id"] for line in out] == ["r1", "r2", "r3", "r4"]
        errors = r.file_lines(batch.error_file_id)
        assert [line["custom_id"] for line in errors] == ["r5", "r6", "r7", "r8"]
        assert {line["error"]["code"] for line in errors} == {"batch_expired"}
        assert batch.failed == 4  # request_counts: total = completed + failed
        assert r.billed()[0] == 4


async def test_a_cancelled_batch_lets_lines_in_flight_finish(
    client: Client, tmp_path: Path
) -> None:
    ids = [f"r{i}" for i in range(1, 9)]
    hold = {f"r{i}": asyncio.Event() for i in range(3, 9)}
    async with rig(client, tmp_path, ids, hold=hold) as r:
        batch_id, expires_at = r.new_batch()
        handle = await r.start(
            batch_id, expires_at, chunk_lines=8, parallel_chunks=1, line_concurrency=1
        )
        await until(lambda: "r3" in r.router.arrived)
        await contracts.CANCEL_BATCH.send(handle, CancelJob(reason="test"))
        await until(lambda: bool(r.stopped))
        hold["r3"].set()
        result = await asyncio.wait_for(handle.result(), 120)
        assert result.status is BatchStatus.CANCELLED
        batch = r.batch(batch_id)
        assert batch.cancelled_at is not None and batch.completed == 3
        assert [x["custom_id"] for x in r.file_lines(batch.output_file_id)] == ["r1", "r2", "r3"]
        errors = r.file_lines(batch.error_file_id)
        assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
        assert len(errors) == 5
        assert "r4" not in r.router.seen  # no line started after the cancel


async def test_continue_as_new_keeps_progress(client: Client, tmp_path: Path) -> None:
    ids = [f"r{i}" for i in range(1, 10)]
    async with rig(client, tmp_path, ids) as r:
        batch_id, expires_at = r.new_batch()
        handle = await r.start(
            batch_id, expires_at, chunk_lines=2, parallel_chunks=1, max_chunks_per_run=2
        )
        first_run = handle.first_execution_run_id
        result = await asyncio.wait_for(handle.result(), 180)
        assert result.status is BatchStatus.COMPLETED and result.completed == 9
        assert (await handle.describe()).run_id != first_run  # it continued as new
        assert sorted(x.custom_id for x in r.results(batch_id)) == sorted(ids)
        assert sorted(r.router.seen) == sorted(ids)  # no line ran twice
        assert r.billed() == (9, 9 * PROMPT, 9 * COMPLETION)
