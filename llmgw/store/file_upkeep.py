"""What keeps the files' content from filling the store: each key's total,
and the removal of content nobody can read any more.

- ``key_bytes``: what a key's files hold now (uploads and its batches'
  results alike, and the chunks of uploads under way), checked against
  ``LLMGW_MAX_KEY_FILE_BYTES`` when an upload begins (router/api/files.py)
  and again, under the key's lock, in the transaction of each chunk an
  upload writes (``key_bytes_in``, llmgw/store/files.py): a chunk is the
  upload's reservation, so uploads of one key at once cannot together pass
  the bound; an upload that fails takes its chunks, and so its reservation,
  with it.
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

from sqlalchemy import ScalarSelect, delete, func, or_, text
from sqlmodel import Session, col, select

from llmgw.store import Store
from llmgw.store.openai_tables import FileChunk, StoredFile

__all__ = [
    "PURGE_PAGE",
    "key_bytes",
    "key_bytes_in",
    "lock_key_files",
    "purge_abandoned",
    "purge_expired",
]

_UPLOADING = "uploading"
# Expired files purged per transaction.
PURGE_PAGE = 100
# PostgreSQL's advisory locks of the key's files (two-int form: this
# namespace and the key's id): one upload's chunk at a time per key.
PG_KEY_FILES_LOCK = 0x6C6C6D03


def key_bytes(store: Store, key_id: int, now: int) -> int:
    """Bytes the key's files hold, uploads under way not counted (the
    early check as an upload begins: ``key_bytes_in`` is the one that
    holds)."""
    with store.session() as session:
        return int(session.exec(select(_files_bytes(key_id, now))).one())


def _files_bytes(key_id: int, now: int) -> ScalarSelect[int]:
    """What the key's files hold: every one not deleted nor expired (a
    staging row's ``bytes`` is 0)."""
    return (
        select(func.coalesce(func.sum(StoredFile.bytes), 0))
        .where(
            StoredFile.key_id == key_id,
            col(StoredFile.deleted_at).is_(None),
            or_(col(StoredFile.expires_at).is_(None), col(StoredFile.expires_at) > now),
        )
        .scalar_subquery()
    )


def key_bytes_in(session: Session, key_id: int, now: int) -> int:
    """Bytes the key's files hold: every file not deleted nor expired, and
    the chunks of its uploads under way (a staging row's ``bytes`` is 0: its
    chunks are its reservation). One statement, so one snapshot: a file
    published meanwhile (its chunks moved from staging to it) is counted
    once, before or after, never missed."""
    staged = (
        select(func.coalesce(func.sum(func.length(FileChunk.data)), 0))
        .join(StoredFile, col(StoredFile.id) == col(FileChunk.file_id))
        .where(StoredFile.key_id == key_id, StoredFile.status == _UPLOADING)
        .scalar_subquery()
    )
    return int(session.exec(select(_files_bytes(key_id, now) + staged)).one())


def lock_key_files(session: Session, key_id: int) -> None:
    """Hold the key's files until the session's transaction ends, so that
    the check of its total and the write it admits are one step across
    every router. PostgreSQL: an advisory lock of the key. SQLite: the
    caller's first statement is a write, which takes the database's write
    lock for the whole transaction (SQLite waits for it from the start of
    the transaction, so no snapshot goes stale)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(
            text("SELECT pg_advisory_xact_lock(:ns, :key)"),
            {"ns": PG_KEY_FILES_LOCK, "key": key_id},
        )


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
