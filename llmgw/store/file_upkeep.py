"""What keeps the files' content from filling the store: each key's total,
and the removal of content nobody can read any more.

- ``key_bytes``: what a key's files hold now (uploads and its batches'
  results alike, and uploads under way), checked against
  ``LLMGW_MAX_KEY_FILE_BYTES`` when an upload begins (router/api/files.py).
  Two uploads of one key at once are each checked against what was stored
  when they began, so together they may pass the bound by one file's size.
- ``purge_expired``: a file past its ``expires_at`` is never listed or
  served (llmgw/store/files.py); its content is deleted and its row kept,
  marked deleted, as ``DELETE /v1/files/{id}`` leaves it (the id is never
  handed out again).
- ``purge_abandoned``: a writer killed mid-way (a router killed during an
  upload) leaves a staging row and its chunks; removed once older than any
  live upload could be.

The control worker's sweeper runs both purges on a timer
(activities/control/jobs_sweeper.py). Synchronous, like the rest of the
store: async callers run these in a thread.
"""

from sqlalchemy import delete, func, or_
from sqlmodel import col, select

from llmgw.store import Store
from llmgw.store.openai_tables import FileChunk, StoredFile

__all__ = ["PURGE_PAGE", "key_bytes", "purge_abandoned", "purge_expired"]

_UPLOADING = "uploading"
# Expired files purged per transaction.
PURGE_PAGE = 100


def key_bytes(store: Store, key_id: int, now: int) -> int:
    """Bytes the key's files hold: every file not deleted nor expired, and
    uploads under way (their bytes are counted as the upload finishes, so an
    upload under way counts 0 until then)."""
    with store.session() as session:
        total = session.exec(
            select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(
                StoredFile.key_id == key_id,
                col(StoredFile.deleted_at).is_(None),
                or_(col(StoredFile.expires_at).is_(None), col(StoredFile.expires_at) > now),
            )
        ).one()
    return int(total)


def purge_expired(store: Store, now: int, limit: int = PURGE_PAGE) -> int:
    """Delete the content of up to ``limit`` files past their expiry (the
    rows stay, marked deleted at ``now``); how many."""
    with store.session() as session:
        ids = list(
            session.exec(
                select(StoredFile.id)
                .where(
                    col(StoredFile.deleted_at).is_(None),
                    col(StoredFile.expires_at).is_not(None),
                    col(StoredFile.expires_at) <= now,
                )
                .limit(limit)
            ).all()
        )
        for file_id in ids:
            session.execute(delete(FileChunk).where(col(FileChunk.file_id) == file_id))
            row = session.get(StoredFile, file_id)
            if row is not None:
                row.deleted_at = now
                row.bytes = 0
                session.add(row)
        session.commit()
    return len(ids)


def purge_abandoned(store: Store, older_than: int) -> int:
    """Remove what writers killed mid-way left (staging rows created before
    ``older_than``, epoch seconds, and their chunks); how many files."""
    with store.session() as session:
        ids = list(
            session.exec(
                select(StoredFile.id).where(
                    StoredFile.status == _UPLOADING, StoredFile.created_at < older_than
                )
            ).all()
        )
        for file_id in ids:
            session.execute(delete(FileChunk).where(col(FileChunk.file_id) == file_id))
            session.execute(delete(StoredFile).where(col(StoredFile.id) == file_id))
        session.commit()
    return len(ids)
