"""Starting jobs: the router's fire-and-forget Jobs link and the control
worker's sweeper, on a real Temporal dev server (the fake router of
tests/control/test_jobs_batch.py answers the lines); and the background
response workflow: retried on a router's 5xx, ended by its cancel."""

import asyncio
import time
import uuid
from pathlib import Path

from sqlmodel import select
from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy

from activities.control.jobs_sweeper import Sweeper
from llmgw import contracts
from llmgw.queues import response_workflow_id
from llmgw.store import Store
from llmgw.store import files as fs
from llmgw.store.openai_tables import BatchRecord, FileChunk, ResponseRecord, StoredFile
from llmgw.types import BatchRun, BatchStatus, CancelJob, ResponseRun
from router.control_link.jobs import Jobs
from tests.control.test_jobs_batch import KEY_ID, Rig, rig, until
from tests.control.test_sweeper_store_frozen import files_to_tidy


def unstarted_batch(r: Rig, age_s: float) -> str:
    batch_id, _ = r.new_batch()
    with r.store.session() as session:
        row = session.get(BatchRecord, batch_id)
        assert row is not None
        row.created_at = int(time.time() - age_s)
        session.add(row)
        session.commit()
    return batch_id


def started_at(r: Rig, batch_id: str) -> int | None:
    return r.batch(batch_id).started_at


async def test_the_sweeper_starts_a_batch_no_router_started(client: Client, tmp_path: Path) -> None:
    async with rig(client, tmp_path, ["r1", "r2", "r3"]) as r:
        young = unstarted_batch(r, age_s=0)
        old = unstarted_batch(r, age_s=60)
        ended = unstarted_batch(r, age_s=60)
        with r.store.session() as session:
            row = session.get(BatchRecord, ended)
            assert row is not None
            row.status = BatchStatus.CANCELLED.value  # cancelled before any workflow
            session.add(row)
            session.commit()
        defaults = BatchRun(batch_id="", expires_at=0)
        sweeper = Sweeper(r.store, client, defaults, min_age_s=30, task_queue=r.queue)
        assert await sweeper.once() == 1
        assert await sweeper.once() == 0  # marked: not started twice
        assert started_at(r, young) is None and started_at(r, ended) is None
        await until(lambda: r.batch(old).status == BatchStatus.COMPLETED.value)
        assert r.batch(old).completed == 3


async def test_jobs_starts_a_batch_in_the_background(client: Client, tmp_path: Path) -> None:
    async with rig(client, tmp_path, ["r1", "r2"]) as r:
        batch_id, _ = r.new_batch()
        jobs = Jobs(lambda: client, r.store, task_queue=r.queue)
        jobs.start_batch(batch_id)  # returns at once
        jobs.start_batch(batch_id)  # a second start joins the first
        await until(lambda: r.batch(batch_id).status == BatchStatus.COMPLETED.value)
        assert started_at(r, batch_id) is not None
        assert sorted(r.router.seen) == ["r1", "r2"]
        await jobs.aclose()


async def test_jobs_without_temporal_only_logs(tmp_path: Path) -> None:
    dead = await Client.connect("127.0.0.1:1", lazy=True)
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    jobs = Jobs(lambda: dead, store)
    jobs.start_response("resp_x")
    jobs.cancel_batch("batch_x")
    await jobs.aclose()  # nothing raised; the sweeper will start them
    store.close()


def _response(store: Store, response_id: str = "") -> str:
    """A queued background response of the rig's key (the activity runs it
    with the exec token bound to that key)."""
    response_id = response_id or f"resp_{uuid.uuid4().hex}"
    with store.session() as session:
        session.add(
            ResponseRecord(
                id=response_id, key_id=KEY_ID, model="m1", status="queued",
                background=True, created_at=int(time.time()),
            )
        )  # fmt: skip
        session.commit()
    return response_id


async def test_a_background_response_is_retried_on_a_router_error(
    client: Client, tmp_path: Path
) -> None:
    async with rig(client, tmp_path, [], run_busy=2) as r:
        response_id = _response(r.store)
        result = await contracts.RESPONSE.execute(
            client, ResponseRun(response_id=response_id),
            id=response_workflow_id(response_id), task_queue=r.queue,
        )  # fmt: skip
        assert result.status == "completed" and result.last_seq == 2
        assert r.router.runs == [response_id] * 3  # two 502s, then served


async def test_a_background_response_is_cancelled_by_its_signal(
    client: Client, tmp_path: Path
) -> None:
    response_id = f"resp_{uuid.uuid4().hex}"
    async with rig(client, tmp_path, [], hold={response_id: asyncio.Event()}) as r:
        _response(r.store, response_id)
        handle = await contracts.RESPONSE.start(
            client, ResponseRun(response_id=response_id),
            id=response_workflow_id(response_id), task_queue=r.queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        )  # fmt: skip
        await until(lambda: bool(r.router.runs))
        await contracts.CANCEL_RESPONSE.send(handle, CancelJob(reason="test"))
        # The router never ends it: past the grace, the activity is cancelled.
        result = await asyncio.wait_for(handle.result(), 120)
        assert result.status == "cancelled"


async def test_the_sweeper_tidies_expired_and_abandoned_files(
    client: Client, tmp_path: Path
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'files.db'}")
    store.migrate()
    try:
        # An expired file, a kept one, and a router killed mid-upload long ago.
        expired, kept, staging_id = files_to_tidy(store)
        defaults = BatchRun(batch_id="", expires_at=0)
        sweeper = Sweeper(store, client, defaults, files_interval_s=0)

        def chunks() -> set[str]:
            with store.session() as session:
                return set(session.exec(select(FileChunk.file_id)).all())

        running = asyncio.create_task(sweeper.forever(0.05))
        try:
            await until(lambda: chunks() == {kept})
        finally:
            running.cancel()
        with store.session() as session:
            row = session.get(StoredFile, expired)
            assert row is not None and row.deleted_at is not None
            assert session.get(StoredFile, staging_id) is None
        assert b"".join(fs.read_chunks(store, kept)) == b"y"
    finally:
        store.close()
