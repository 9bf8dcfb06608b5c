"""The key's bound on all its files (``LLMGW_MAX_KEY_FILE_BYTES``) holds
under parallel uploads (issue 34): every upload has begun, and written its
first chunk, before any finishes; together they ask for nearly twice the
bound. Each checked only against what was stored when it began, all were
taken (N uploads overshot by N - 1 files); now each chunk reserves its bytes
under the key's lock as it is written, so what the key holds never passes
the bound, the uploads refused get a 413 ``file_storage_full`` and leave
nothing, and at least one goes through.

Real uploads over HTTP to the router app served by uvicorn, on SQLite and
on a real PostgreSQL (the ``store_url`` fixture).
"""

import asyncio
from collections.abc import AsyncIterator

import httpx
from sqlmodel import func, select

from llmgw.store import Store, file_upkeep
from llmgw.store.openai_tables import FILE_CHUNK_BYTES, StoredFile
from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from tests.gateway.test_files import router, until

K = FILE_CHUNK_BYTES
UPLOADS = 3
# Each upload: two and a half chunks. The bound: four chunks, room for every
# upload's first chunk (so all are under way at once) but for one file only.
FILE_BYTES = 2 * K + K // 2
BOUND = 4 * K
BOUNDARY = b"parallel-uploads"


async def _body(release: asyncio.Event) -> AsyncIterator[bytes]:
    """A multipart upload: the purpose and a first chunk and a bit of the
    file (so the router begins writing it), then the rest once released."""
    yield (
        b'--%s\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--%s\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" % (BOUNDARY, BOUNDARY)
    )
    first = K + 4096
    yield b"x" * first
    await release.wait()
    yield b"x" * (FILE_BYTES - first)
    yield b"\r\n--%s--\r\n" % BOUNDARY


def _staging(store: Store) -> int:
    with store.session() as session:
        return int(
            session.exec(
                select(func.count()).select_from(StoredFile).where(StoredFile.status == "uploading")
            ).one()
        )


async def test_parallel_uploads_stay_within_the_keys_bound(store_url: str) -> None:
    async with router(store_url, max_key_file_bytes=BOUND) as r:
        info, key = create_key(r.store, "k", KeyPolicy())
        key_id = info.id
        release = asyncio.Event()
        async with httpx.AsyncClient(base_url=r.base, timeout=60) as http:
            uploads = [
                asyncio.create_task(
                    http.post(
                        "/v1/files",
                        content=_body(release),
                        headers={
                            "Authorization": f"Bearer {key}",
                            "Content-Type": f"multipart/form-data; boundary={BOUNDARY.decode()}",
                        },
                    )
                )
                for _ in range(UPLOADS)
            ]
            # Every upload under way (its staging row written) before any ends.
            await until(lambda: _staging(r.store) == UPLOADS or any(u.done() for u in uploads))
            assert not any(u.done() for u in uploads), [
                u.result().text for u in uploads if u.done()
            ]
            release.set()
            answers = await asyncio.gather(*uploads)

        taken = [a.json() for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code != 200]
        assert taken, [(a.status_code, a.text[:150]) for a in answers]
        assert sum(f["bytes"] for f in taken) <= BOUND, (len(taken), [a.text for a in answers])
        for answer in refused:
            assert answer.status_code == 413, answer.text
            assert answer.json()["error"]["code"] == "file_storage_full", answer.text
        # The refused left nothing: only the files taken, and the key's total within its bound.
        await until(lambda: _staging(r.store) == 0)
        files, chunks = r.rows()
        assert files == len(taken) and chunks == len(taken) * 3
        held = file_upkeep.key_bytes(r.store, key_id, 0)
        assert held == len(taken) * FILE_BYTES <= BOUND
