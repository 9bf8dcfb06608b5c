"""An upload whose store (PostgreSQL) freezes (SIGSTOP) while the upload is
held, by a lock, in one of its store calls: the check of the key's total
(``LLMGW_MAX_KEY_FILE_BYTES``, llmgw/store/file_upkeep.py), the write of a
chunk, or the last transaction that makes the file (``finish``).

What a client must see: an OpenAI-format 503 ``store_unavailable`` within
the router's store bound (not a hang), whether the body had all arrived or
was still arriving; nothing of the file kept (no row, no chunk, nothing
listed) once the store resumes (SIGCONT), even when the last transaction,
given up on, lands late; and then the same upload succeeds and is listed
once. (Before router/api/files.py bounded the writer's calls, a freeze in a
chunk write or in ``finish`` left the client waiting until it gave up.)

Real processes: a PostgreSQL server of the test's own (tests/pg.py), frozen;
the router app served by uvicorn, called with the official openai client.
"""

import asyncio
import contextlib
from collections.abc import Iterator

import openai
import psycopg
import pytest

from llmgw.store.openai_tables import FILE_CHUNK_BYTES
from tests.gateway.test_files import jsonl, router, until
from tests.pg import PgCluster, frozen, own_cluster

Connection = psycopg.Connection[tuple[object, ...]]

# The router's bound on a store call on a request's path (shipped: 2 s).
STORE_WAIT_S = 1.0
# The client's own bound: an upload the router lets hang fails the test.
CLIENT_TIMEOUT_S = 30.0


@pytest.fixture
def own_pg() -> Iterator[PgCluster]:
    with own_cluster() as cluster:
        yield cluster


def waiting(store_url: str, query: str) -> bool:
    """Whether a session waits for a lock in a statement LIKE ``query``. A
    connection of its own: within a transaction the view does not change."""
    with psycopg.connect(store_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE %s AND pid <> pg_backend_pid()",
            (query,),
        ).fetchone()
    return row is not None and int(str(row[0])) > 0


async def until_waiting(store_url: str, query: str, upload: "asyncio.Task[object]") -> None:
    async with asyncio.timeout(60):
        while not await asyncio.to_thread(waiting, store_url, query):
            assert not upload.done(), upload
            await asyncio.sleep(0.05)


async def held_in(stage: str, store_url: str, upload: "asyncio.Task[object]") -> Connection:
    """Hold the upload, by a lock, in ``stage``: the key's total, the write
    of a chunk, or the last transaction that makes the file (``finish``);
    the connection holding it (its rollback lets the upload go on)."""
    with contextlib.ExitStack() as on_failure:
        first = on_failure.enter_context(psycopg.connect(store_url))
        holder = await _hold(stage, store_url, upload, first)
        if holder is first:
            on_failure.pop_all()
        else:
            first.close()
    return holder


async def _hold(
    stage: str, store_url: str, upload: "asyncio.Task[object]", first: Connection
) -> Connection:
    if stage == "key_check":
        first.execute("LOCK TABLE openai_files IN ACCESS EXCLUSIVE MODE")
        await until_waiting(store_url, "%sum(openai_files.bytes)%", upload)
        return first
    first.execute("LOCK TABLE openai_file_chunks IN ACCESS EXCLUSIVE MODE")
    await until_waiting(store_url, "%INSERT INTO openai_file_chunks%", upload)
    if stage == "chunk_write":
        return first
    # The staging row is written: held by a row lock while the chunks go on,
    # the file's last transaction waits for it.
    second = psycopg.connect(store_url)
    try:
        [_] = second.execute(
            "SELECT id FROM openai_files WHERE status = 'uploading' FOR UPDATE"
        ).fetchall()
        first.rollback()
        await until_waiting(store_url, "%DELETE FROM openai_files%", upload)
    except BaseException:
        second.close()
        raise
    return second


@pytest.mark.parametrize("stage", ["key_check", "chunk_write", "finish"])
@pytest.mark.parametrize("size", ["one_chunk", "three_chunks"])
async def test_an_upload_whose_store_freezes_gets_503_and_keeps_nothing(
    own_pg: PgCluster, stage: str, size: str
) -> None:
    # One chunk: the body has all arrived when the store is first called.
    # Three: the first chunk is written while the rest is on its way.
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
        try:
            assert (await client.files.list()).data == []  # the key is known now
            upload = asyncio.create_task(
                client.files.create(file=("in.jsonl", content), purpose="batch")
            )
            holder = await held_in(stage, store_url, upload)
            try:
                with frozen(own_pg, then=holder), pytest.raises(openai.APIStatusError) as caught:
                    await upload
            finally:
                holder.close()
            error = caught.value
            assert error.status_code == 503, error
            assert isinstance(error.body, dict)
            assert error.body["code"] == "store_unavailable"
            assert error.body["type"] and error.body["message"]
            # Resumed: what was written of it is removed (once the call the
            # router gave up on has ended), and the upload goes through.
            await until(lambda: r.rows() == (0, 0))
            # From here a client that retries a 503 as told ("retry shortly"): on a
            # loaded machine a call just after the thaw may still pass the 1 s bound
            # (CI once saw it), which is the router working, not the upload failing.
            after = client.with_options(max_retries=4)
            assert (await after.files.list()).data == []
            done = await after.files.create(file=("in.jsonl", content), purpose="batch")
            assert done.bytes == len(content)
            assert [f.id for f in (await after.files.list()).data] == [done.id]
            assert (await after.files.content(done.id)).content == content
            files, chunks = r.rows()
            assert files == 1 and chunks == -(-len(content) // FILE_CHUNK_BYTES)
        finally:
            await client.close()
