"""The jobs' sweeper (activities/control/jobs_sweeper.py) while its
PostgreSQL store is frozen (every server process stopped by SIGSTOP) in the
middle of tidying files.

What an operator must see: each pass gives up on the store within the
sweeper's bound and says so in the log, then the next pass tries again (the
loop is not wedged on one query that a frozen server never answers, and a
frozen store holds one of the worker's threads and connections, not one per
pass); once the store resumes (SIGCONT) the expired and abandoned files are
tidied with no help, and a kept file's content is untouched.

Real processes: a PostgreSQL server of the test's own (tests/pg.py), frozen,
and the session's Temporal dev server (the sweeper's job starts talk to it);
the sweeper in the test's process with a short bound, then in the control
worker (``llmgw control``) as shipped (30 s bound, files tidied every 60 s).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlmodel import select
from temporalio.client import Client

from activities.control.jobs_sweeper import Sweeper
from llmgw.store import Store
from llmgw.store import files as fs
from llmgw.store.openai_tables import FILE_CHUNK_BYTES, FileChunk, StoredFile
from llmgw.types import BatchRun
from llmgw_cli.procs import wait_for
from tests.control.test_jobs_batch import until
from tests.harness import System, free_port
from tests.pg import PgCluster, frozen, own_cluster

# The sweeper's bound on a store call, short for the test (shipped: 30 s).
WAIT_S = 1.0
SWEEPER_LOG = "activities.control.jobs"


@pytest.fixture
def own_pg() -> Iterator[PgCluster]:
    with own_cluster() as cluster:
        yield cluster


def files_to_tidy(store: Store) -> tuple[str, str, str]:
    """An expired file, a kept one and an upload a killed router left six
    hours and more ago: (expired, kept, staging) ids."""
    now = int(time.time())
    expired = fs.write_file(store, 1, "old", "batch", [b"x"], max_bytes=10, expires_at=now)
    kept = fs.write_file(store, 1, "kept", "batch", [b"y"], max_bytes=10)
    writer = fs.FileWriter(store, 1, "half", "batch", max_bytes=10 * FILE_CHUNK_BYTES)
    writer.write(b"z" * FILE_CHUNK_BYTES)
    with store.session() as session:
        [staging] = session.exec(select(StoredFile).where(StoredFile.status == "uploading"))
        staging.created_at = now - 7 * 3600
        staging_id = staging.id
        session.add(staging)
        session.commit()
    return expired.id, kept.id, staging_id


def waiting_on_files(store_url: str) -> bool:
    """Whether a session waits for the files table's lock (the tidy's query).
    A connection of its own: within a transaction the view does not change."""
    with psycopg.connect(store_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%openai_files%' AND pid <> pg_backend_pid()"
        ).fetchone()
    return row is not None and int(str(row[0])) > 0


async def test_a_frozen_store_mid_tidy_is_retried_and_tidied_once_it_resumes(
    client: Client, own_pg: PgCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, SWEEPER_LOG)
    store_url = own_pg.create_database()
    store = Store(store_url)
    store.migrate()
    locker = psycopg.connect(store_url)
    running: asyncio.Task[None] | None = None
    try:
        expired, kept, staging = files_to_tidy(store)
        sweeper = Sweeper(
            store, client, BatchRun(batch_id="", expires_at=0), files_interval_s=0,
            store_wait_s=WAIT_S,
        )  # fmt: skip

        def chunks() -> set[str]:
            with store.session() as session:
                return set(session.exec(select(FileChunk.file_id)).all())

        def sweep_failures() -> int:
            return sum("sweep failed" in r.getMessage() for r in caplog.records)

        # The files table locked, so the tidy is surely under way (waiting on
        # it) when the store is frozen.
        locker.execute("LOCK TABLE openai_files IN ACCESS EXCLUSIVE MODE")
        running = asyncio.create_task(sweeper.forever(0.05))
        await until(lambda: waiting_on_files(store_url), 60)
        with frozen(own_pg, then=locker):
            # Each pass gives up within its bound and the next one tries
            # again: three failures said, on one stuck connection.
            await until(lambda: sweep_failures() >= 3, 60)
            assert store.engine.pool.checkedout() <= 1  # type: ignore[attr-defined]
            assert not running.done()
        # Resumed: the expired content and the abandoned upload are gone.
        await until(lambda: chunks() == {kept}, 60)
        with store.session() as session:
            row = session.get(StoredFile, expired)
            assert row is not None and row.deleted_at is not None and row.bytes == 0
            assert session.get(StoredFile, staging) is None
        assert b"".join(fs.read_chunks(store, kept)) == b"y"
        said = [r.getMessage() for r in caplog.records if "sweep failed" in r.getMessage()]
        assert all(f"did not answer within {WAIT_S:g} s" in m for m in said), said
    finally:
        if running is not None:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        locker.close()
        store.close()


@pytest.mark.timeout(600)
def test_the_control_worker_tidies_files_once_its_store_frozen_mid_tidy_resumes(
    temporal_address: str, tmp_path: Path, own_pg: PgCluster
) -> None:
    system = System(temporal_address, tmp_path / "llmgw", free_port())
    system.work_dir.mkdir()
    system.store_url = own_pg.create_database()
    system.env["LLMGW_STORE_URL"] = system.store_url
    store = Store(system.store_url)
    store.migrate()
    locker = psycopg.connect(system.store_url)
    try:
        expired, kept, staging = files_to_tidy(store)

        def chunks() -> set[str]:
            with store.session() as session:
                return set(session.exec(select(FileChunk.file_id)).all())

        # Its first tidy (at its start) held on the files table, then frozen.
        locker.execute("LOCK TABLE openai_files IN ACCESS EXCLUSIVE MODE")
        control = system.spawn("control")
        assert wait_for(lambda: waiting_on_files(system.store_url), 120), control.log_tail()
        with frozen(own_pg, then=locker):
            said = "file sweep failed: the store did not answer within 30 s"
            assert wait_for(lambda: said in control.log_path.read_text(), 120), control.log_tail()
            assert control.alive()
        # Resumed: the next tidy (60 s after the first) removes the rest.
        assert wait_for(lambda: chunks() == {kept}, 180), control.log_tail()
        with store.session() as session:
            row = session.get(StoredFile, expired)
            assert row is not None and row.deleted_at is not None
            assert session.get(StoredFile, staging) is None
        assert control.alive()
    finally:
        system.stop()
        locker.close()
        store.close()
