"""Files in the store (``/v1/files``, a batch's output and error files).

A file's content is rows of at most ``FILE_CHUNK_BYTES`` (``FileChunk``),
written one transaction per chunk and read one row at a time: neither an
upload, a download nor a batch's validation ever holds a whole file, and any
router or control worker on any host reaches the content through the store
it already has.

Writing goes to a *staging* id: the chunks are written under it, and one
last transaction moves them to the file's id, deleting what the id held
before, and marks the file ``processed``. So a reader sees the whole old
content or the whole new one, never a part; a file past its bound, or a
writer that fails, removes its staging rows and leaves nothing; and writing
the same ``file_id`` again (a retried batch finalize, whose ids are
deterministic) replaces its content idempotently. A writer killed mid-way
leaves a staging row (status ``uploading``, never listed or served) and its
chunks: ``purge_abandoned`` (llmgw/store/file_upkeep.py) removes them.

Every read of a file's metadata names the key: another key's file is simply
not found. Synchronous (SQLModel sessions): async callers run these in a
thread.
"""

import hashlib
import re
import secrets
import string
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

from sqlalchemy import ColumnElement, delete, or_, update
from sqlmodel import Session, col, select

from llmgw.errors import FileTooLarge, KeyStorageFull
from llmgw.store import Store, file_upkeep
from llmgw.store.openai_tables import FILE_CHUNK_BYTES, FileChunk, StoredFile

__all__ = [
    "FILE_CHUNK_BYTES",
    "FileWriter",
    "delete_file",
    "get_file",
    "is_file_id",
    "iter_lines",
    "list_files",
    "new_file_id",
    "read_chunks",
    "split_lines",
    "write_file",
]

_BASE62 = string.digits + string.ascii_letters
PROCESSED = "processed"
UPLOADING = "uploading"
_STAGING_PREFIX = "file-staging-"


def new_file_id() -> str:
    """A new file id: ``file-`` and 24 base62 characters (OpenAI's shape)."""
    return "file-" + "".join(secrets.choice(_BASE62) for _ in range(24))


# What every file id looks like (``new_file_id``, the batch results' ids).
_FILE_ID = re.compile(r"file-[0-9A-Za-z]{1,64}")


def is_file_id(text: str) -> bool:
    """Whether ``text`` has a file id's shape. Text without it names no file
    and is never sent to the store: PostgreSQL refuses a NUL in a text
    parameter with an error, not an empty answer, which the request path
    reads as the store failing (a 503 for a client's made-up id)."""
    return _FILE_ID.fullmatch(text) is not None


def _live(now: int) -> list[ColumnElement[bool]]:
    """The conditions of a file a client may see."""
    return [
        col(StoredFile.status) == PROCESSED,
        col(StoredFile.deleted_at).is_(None),
        or_(col(StoredFile.expires_at).is_(None), col(StoredFile.expires_at) > now),
    ]


class FileWriter:
    """One file being written, a chunk at a time: ``write`` as the bytes come,
    then ``finish`` (or ``abort``). Each call is a short store transaction at
    most, so an async caller runs each in a thread without holding the
    content: at most one chunk is buffered here."""

    def __init__(
        self,
        store: Store,
        key_id: int,
        filename: str,
        purpose: str,
        *,
        max_bytes: int,
        file_id: str | None = None,
        expires_at: int | None = None,
        clock: Callable[[], int] | None = None,
        key_total: int | None = None,
        key_used: int = 0,
    ) -> None:
        self._store = store
        self._key_id = key_id
        self._filename = filename
        self.purpose = purpose
        self._max = max_bytes
        # The key's bound on all its files (None: none, a batch's results),
        # and what they held when this file began.
        self._key_total = key_total
        self._key_used = key_used
        self.file_id = file_id or new_file_id()
        self.expires_at = expires_at
        self._now = clock or (lambda: int(time.time()))
        self._staging = _STAGING_PREFIX + secrets.token_hex(12)
        self._buffer = bytearray()
        self._next_idx = 0
        self._size = 0
        self._stored = 0  # bytes in committed chunks
        self._sha = hashlib.sha256()
        self._open = False
        self._done = False
        self._published = False

    @property
    def size(self) -> int:
        """Bytes taken so far."""
        return self._size

    def _begin(self) -> None:
        # The staging row makes a killed writer's chunks findable (purge_abandoned).
        with self._store.session() as session:
            session.add(
                StoredFile(
                    id=self._staging,
                    key_id=self._key_id,
                    filename=self._filename,
                    purpose=self.purpose,
                    status=UPLOADING,
                    created_at=self._now(),
                )
            )
            session.commit()
        self._open = True

    def write(self, data: bytes) -> None:
        """Take the next bytes; FileTooLarge (everything written removed) past the bound."""
        if self._done:
            raise RuntimeError("the file is finished")
        self._size += len(data)
        if self._size > self._max:
            self.abort()
            raise FileTooLarge(self._max)
        if self._key_total is not None and self._key_used + self._size > self._key_total:
            self.abort()
            raise KeyStorageFull(self._key_total, self._key_used)
        self._sha.update(data)
        self._buffer += data
        while len(self._buffer) >= FILE_CHUNK_BYTES:
            self._flush(bytes(self._buffer[:FILE_CHUNK_BYTES]))
            del self._buffer[:FILE_CHUNK_BYTES]

    def _flush(self, piece: bytes) -> None:
        if not self._open:
            self._begin()
        try:
            with self._store.session() as session:
                if self._key_total is not None:
                    file_upkeep.lock_key_files(session, self._key_id)
                # The chunk first: SQLite's write lock from the transaction's start.
                session.add(FileChunk(file_id=self._staging, idx=self._next_idx, data=piece))
                session.flush()
                if self._key_total is not None:
                    self._check_key_total(session, len(piece))
                session.commit()
        except BaseException:
            self.abort()
            raise
        self._next_idx += 1
        self._stored += len(piece)

    def _check_key_total(self, session: Session, piece: int) -> None:
        """The key's files, this chunk included, within their bound, read
        under the key's lock: the chunk reserves its bytes as it commits, so
        parallel uploads of one key cannot each pass on what the others
        have not finished yet (each checked only at its start, N uploads
        overshot the bound by N - 1 files)."""
        assert self._key_total is not None
        used = file_upkeep.key_bytes_in(session, self._key_id, self._now())
        if used > self._key_total:
            # Removed under the same lock: a parallel upload checking next
            # must not count what this one is giving up (it would be refused
            # too, each for the others, none taken).
            self._remove_staging(session)
            session.commit()
            self._open = False
            raise KeyStorageFull(self._key_total, used - self._stored - piece)

    def _remove_staging(self, session: Session) -> None:
        session.execute(delete(FileChunk).where(col(FileChunk.file_id) == self._staging))
        session.execute(delete(StoredFile).where(col(StoredFile.id) == self._staging))

    def finish(self) -> StoredFile:
        """Make the file what was written: its old content (if any) replaced
        in one transaction; the file as stored."""
        if self._done:
            raise RuntimeError("the file is finished")
        try:
            if self._buffer:
                self._flush(bytes(self._buffer))
                self._buffer.clear()
            if not self._open:
                self._begin()
            with self._store.session() as session:
                row = self._publish(session)
                session.commit()
                session.refresh(row)
                session.expunge(row)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._published = True
        return row

    def _publish(self, session: Session) -> StoredFile:
        session.execute(delete(FileChunk).where(col(FileChunk.file_id) == self.file_id))
        session.execute(
            update(FileChunk)
            .where(col(FileChunk.file_id) == self._staging)
            .values(file_id=self.file_id)
        )
        session.execute(delete(StoredFile).where(col(StoredFile.id) == self._staging))
        row = session.get(StoredFile, self.file_id)
        if row is None:
            row = StoredFile(
                id=self.file_id,
                key_id=self._key_id,
                filename=self._filename,
                purpose=self.purpose,
                created_at=self._now(),
            )
        row.key_id = self._key_id
        row.filename = self._filename
        row.purpose = self.purpose
        row.bytes = self._size
        row.sha256 = self._sha.hexdigest()
        row.status = PROCESSED
        row.deleted_at = None
        row.expires_at = self.expires_at
        session.add(row)
        return row

    def abort(self) -> None:
        """Remove everything written; the file (if it existed) is left as it was."""
        self._done = True
        self._buffer.clear()
        if not self._open:
            return
        with self._store.session() as session:
            self._remove_staging(session)
            session.commit()
        self._open = False

    def discard(self) -> None:
        """Leave nothing of this writer: ``abort`` before ``finish``; after it,
        the file it made removed whole, row and content (an upload answered
        with an error after all: its id never reached anyone). Only for a
        writer of a new id: a replaced file's old content is gone already."""
        if not self._published:
            self.abort()
            return
        with self._store.session() as session:
            session.execute(delete(FileChunk).where(col(FileChunk.file_id) == self.file_id))
            session.execute(delete(StoredFile).where(col(StoredFile.id) == self.file_id))
            session.commit()


def write_file(
    store: Store,
    key_id: int,
    filename: str,
    purpose: str,
    chunks: Iterable[bytes],
    *,
    max_bytes: int,
    file_id: str | None = None,
    expires_at: int | None = None,
) -> StoredFile:
    """Store a file from ``chunks`` (re-cut to FILE_CHUNK_BYTES), ``processed``.

    FileTooLarge past ``max_bytes``, leaving nothing behind. With ``file_id``,
    that file's content is replaced, all at once (idempotent: the same
    content written twice gives the same file).
    """
    writer = FileWriter(
        store, key_id, filename, purpose, max_bytes=max_bytes, file_id=file_id,
        expires_at=expires_at,
    )  # fmt: skip
    try:
        for data in chunks:
            writer.write(data)
    except BaseException:
        writer.abort()
        raise
    return writer.finish()


def get_file(store: Store, key_id: int, file_id: str) -> StoredFile | None:
    """The file, or None when it is missing, deleted, expired, still being
    written or another key's."""
    if not is_file_id(file_id):
        return None
    with store.session() as session:
        row = session.exec(
            select(StoredFile).where(
                StoredFile.id == file_id, StoredFile.key_id == key_id, *_live(int(time.time()))
            )
        ).first()
        if row is not None:
            session.expunge(row)
        return row


def read_chunks(store: Store, file_id: str) -> Iterator[bytes]:
    """The file's content, one chunk row (one short session) at a time.

    The caller has checked the file is the key's (``get_file``)."""
    idx = -1
    while True:
        with store.session() as session:
            chunk = session.exec(
                select(FileChunk)
                .where(FileChunk.file_id == file_id, FileChunk.idx > idx)
                .order_by(col(FileChunk.idx))
                .limit(1)
            ).first()
            if chunk is None:
                return
            idx, data = chunk.idx, chunk.data
        yield data


def iter_lines(store: Store, file_id: str) -> Iterator[tuple[int, bytes]]:
    """The file's lines with their 1-based numbers, without the newline (nor
    a ``\\r`` before it). A line may span chunks; a last line without a
    newline counts, an empty tail after the last newline does not."""
    return split_lines(read_chunks(store, file_id))


def split_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """``chunks`` cut into numbered lines (as ``iter_lines``), in work
    linear in their size: only each new chunk is split, and a line's pieces
    are joined once, at its end (re-joining the line so far to every chunk
    made a long line quadratic: 64 MiB took 1.6 s of the router's GIL)."""
    number = 0
    pending: list[bytes] = []
    for data in chunks:
        pieces = data.split(b"\n")
        if len(pieces) == 1:
            pending.append(pieces[0])
            continue
        pending.append(pieces[0])
        number += 1
        yield number, b"".join(pending).removesuffix(b"\r")
        for piece in pieces[1:-1]:
            number += 1
            yield number, piece.removesuffix(b"\r")
        pending = [pieces[-1]]
    tail = b"".join(pending)
    if tail:
        yield number + 1, tail.removesuffix(b"\r")


def list_files(
    store: Store,
    key_id: int,
    *,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
) -> tuple[list[StoredFile], bool]:
    """A page of the key's files by ``(created_at, id)``, and whether more follow.

    ``after`` is the last id of the previous page (a keyset: pages stay right
    while files come and go); an id that is not the key's starts from the top.
    """
    if purpose is not None and "\x00" in purpose:
        return [], False  # no purpose holds a NUL (and PostgreSQL refuses one)
    if after is not None and not is_file_id(after):
        after = None  # no file's id: from the top, as for another key's
    now = int(time.time())
    with store.session() as session:
        query = select(StoredFile).where(StoredFile.key_id == key_id, *_live(now))
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        if after is not None:
            mark = session.exec(
                select(StoredFile).where(StoredFile.id == after, StoredFile.key_id == key_id)
            ).first()
            if mark is not None:
                at, ident = mark.created_at, mark.id
                if order == "desc":
                    query = query.where(
                        or_(
                            col(StoredFile.created_at) < at,
                            (col(StoredFile.created_at) == at) & (col(StoredFile.id) < ident),
                        )
                    )
                else:
                    query = query.where(
                        or_(
                            col(StoredFile.created_at) > at,
                            (col(StoredFile.created_at) == at) & (col(StoredFile.id) > ident),
                        )
                    )
        if order == "desc":
            query = query.order_by(col(StoredFile.created_at).desc(), col(StoredFile.id).desc())
        else:
            query = query.order_by(col(StoredFile.created_at), col(StoredFile.id))
        rows = list(session.exec(query.limit(limit + 1)).all())
        for row in rows:
            session.expunge(row)
    return rows[:limit], len(rows) > limit


def delete_file(store: Store, key_id: int, file_id: str) -> bool:
    """Delete the key's file: its content goes, its row stays marked deleted
    (so the id is never handed out again). False when there was none."""
    if not is_file_id(file_id):
        return False
    now = int(time.time())
    with store.session() as session:
        row = session.exec(
            select(StoredFile).where(
                StoredFile.id == file_id, StoredFile.key_id == key_id, *_live(now)
            )
        ).first()
        if row is None:
            return False
        session.execute(delete(FileChunk).where(col(FileChunk.file_id) == file_id))
        row.deleted_at = now
        row.bytes = 0
        session.add(row)
        session.commit()
        return True
