"""An upload whose store (PostgreSQL) freezes (SIGSTOP) during the check of
the key's total (``LLMGW_MAX_KEY_FILE_BYTES``, llmgw/store/file_upkeep.py).

What a client must see: an OpenAI-format 503 ``store_unavailable`` within
the router's store bound (not a hang), and nothing of the file kept (no
row, no chunk, nothing listed), whether the body had all arrived or was
still arriving; once the store resumes (SIGCONT) the same upload succeeds
and is listed once.

Real processes: a PostgreSQL server of the test's own (tests/pg.py), frozen;
the router app served by uvicorn, called with the official openai client.
"""

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator

import openai
import psycopg
import pytest

from llmgw.store.openai_tables import FILE_CHUNK_BYTES
from tests.gateway.test_files import jsonl, router
from tests.pg import PgCluster, own_cluster

# The router's bound on a store call on a request's path (shipped: 2 s).
STORE_WAIT_S = 1.0
# The client's own bound: an upload the router lets hang fails the test.
CLIENT_TIMEOUT_S = 30.0


@pytest.fixture
def own_pg() -> Iterator[PgCluster]:
    with own_cluster() as cluster:
        yield cluster


def waiting_on_files(store_url: str) -> bool:
    """Whether a session waits for the files table's lock (the key's total).
    A connection of its own: within a transaction the view does not change."""
    with psycopg.connect(store_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%openai_files%' AND pid <> pg_backend_pid()"
        ).fetchone()
    return row is not None and int(str(row[0])) > 0


@contextlib.contextmanager
def frozen(cluster: PgCluster, then: psycopg.Connection[tuple[object, ...]]) -> Iterator[None]:
    """Every PostgreSQL process stopped for the block; resumed after, then
    ``then``'s transaction (the lock that held the check) rolled back."""
    pids = cluster.pids()
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # a backend just gone
                os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        then.rollback()


@pytest.mark.parametrize("size", ["one_chunk", "three_chunks"])
async def test_an_upload_whose_store_freezes_in_the_key_check_gets_503_and_keeps_nothing(
    own_pg: PgCluster, size: str
) -> None:
    # One chunk: the body has all arrived when the check runs. Three: the
    # check runs at the first chunk, the rest still on its way.
    content = jsonl(10) if size == "one_chunk" else jsonl(300, pad=int(FILE_CHUNK_BYTES / 120))
    assert (len(content) > 2 * FILE_CHUNK_BYTES) == (size == "three_chunks")
    store_url = own_pg.create_database()
    async with router(
        store_url,
        store_wait_s=STORE_WAIT_S,
        key_cache_ttl_s=600,  # the key's answer kept: only the files' calls need the store
        max_key_file_bytes=100 * FILE_CHUNK_BYTES,
    ) as r:
        client = openai.AsyncOpenAI(
            base_url=f"{r.base}/v1", api_key=r.key(), timeout=CLIENT_TIMEOUT_S, max_retries=0
        )
        locker = psycopg.connect(store_url)
        try:
            assert (await client.files.list()).data == []  # the key is known now
            # The files table locked, so the upload is surely in its check
            # (waiting on it) when the store is frozen.
            locker.execute("LOCK TABLE openai_files IN ACCESS EXCLUSIVE MODE")
            upload = asyncio.create_task(
                client.files.create(file=("in.jsonl", content), purpose="batch")
            )
            async with asyncio.timeout(60):
                while not await asyncio.to_thread(waiting_on_files, store_url):
                    assert not upload.done(), upload
                    await asyncio.sleep(0.05)
            with frozen(own_pg, then=locker), pytest.raises(openai.APIStatusError) as caught:
                await upload
            error = caught.value
            assert error.status_code == 503, error
            assert isinstance(error.body, dict)
            assert error.body["code"] == "store_unavailable"
            assert error.body["type"] and error.body["message"]
            # Resumed: nothing of it was kept, and the upload goes through.
            assert r.rows() == (0, 0)
            assert (await client.files.list()).data == []
            done = await client.files.create(file=("in.jsonl", content), purpose="batch")
            assert done.bytes == len(content)
            assert [f.id for f in (await client.files.list()).data] == [done.id]
            assert (await client.files.content(done.id)).content == content
            files, chunks = r.rows()
            assert files == 1 and chunks == -(-len(content) // FILE_CHUNK_BYTES)
        finally:
            locker.close()
            await client.close()
