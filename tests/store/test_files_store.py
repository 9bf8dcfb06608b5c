"""llmgw/store/files.py on SQLite and a real PostgreSQL: content re-cut into
chunks and read back a chunk at a time, lines that span chunks, the size
bound leaving nothing behind, replacing a file's content idempotently,
keyset pages, ownership and deletion."""

from collections.abc import Iterator

import pytest
from sqlmodel import col, func, select

from llmgw.errors import FileTooLarge, KeyStorageFull
from llmgw.store import Store, file_upkeep
from llmgw.store import files as fs
from llmgw.store.openai_tables import FILE_CHUNK_BYTES, FileChunk, StoredFile

K = FILE_CHUNK_BYTES


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    store = Store(store_url)
    store.migrate()
    yield store
    store.close()


def _rows(store: Store) -> tuple[int, int]:
    """How many file rows and chunk rows the store holds."""
    with store.session() as session:
        files = session.exec(select(func.count()).select_from(StoredFile)).one()
        chunks = session.exec(select(func.count()).select_from(FileChunk)).one()
    return files, chunks


def _chunk_sizes(store: Store, file_id: str) -> list[int]:
    with store.session() as session:
        rows = session.exec(
            select(FileChunk).where(FileChunk.file_id == file_id).order_by(col(FileChunk.idx))
        ).all()
        return [len(r.data) for r in rows]


def test_new_ids_have_openais_shape() -> None:
    ids = {fs.new_file_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("file-") and len(i) == 29 and i[5:].isalnum() for i in ids)


def test_content_is_recut_into_chunks_and_lines_span_them(store: Store) -> None:
    # Lines whose newlines fall just before, on and after chunk boundaries,
    # fed in pieces that are not chunk-sized either.
    lines = [b"a" * (K - 1), b"b" * K, b"", b"c" * 10, b"d" * (2 * K + 3), b"last"]
    content = b"\n".join(lines)  # no newline after the last line
    pieces = [content[i : i + 777_777] for i in range(0, len(content), 777_777)]
    f = fs.write_file(store, 1, "in.jsonl", "batch", pieces, max_bytes=len(content))
    assert (f.status, f.bytes, f.filename, f.purpose) == (
        "processed",
        len(content),
        "in.jsonl",
        "batch",
    )
    sizes = _chunk_sizes(store, f.id)
    assert all(s == K for s in sizes[:-1]) and 0 < sizes[-1] <= K
    assert b"".join(fs.read_chunks(store, f.id)) == content
    assert list(fs.iter_lines(store, f.id)) == list(enumerate(lines, 1))
    # A trailing newline ends the last line; CRLF lines lose their \r.
    g = fs.write_file(store, 1, "crlf.jsonl", "batch", [b"x\r\n", b"y\r", b"\n"], max_bytes=100)
    assert list(fs.iter_lines(store, g.id)) == [(1, b"x"), (2, b"y")]
    empty = fs.write_file(store, 1, "empty.jsonl", "batch", [], max_bytes=100)
    assert empty.bytes == 0 and list(fs.iter_lines(store, empty.id)) == []


def test_past_the_bound_nothing_is_left(store: Store) -> None:
    before = _rows(store)
    with pytest.raises(FileTooLarge):
        fs.write_file(store, 1, "big", "batch", [b"x" * K, b"x" * K, b"x"], max_bytes=2 * K)
    assert _rows(store) == before
    # Exactly at the bound is fine.
    f = fs.write_file(store, 1, "ok", "batch", [b"x" * K, b"x" * K], max_bytes=2 * K)
    assert f.bytes == 2 * K


def test_writing_a_file_id_again_replaces_its_content_whole(store: Store) -> None:
    first = fs.write_file(
        store, 7, "out.jsonl", "batch_output", [b"1" * (3 * K)], max_bytes=4 * K, file_id="file-out"
    )
    assert first.id == "file-out" and len(_chunk_sizes(store, "file-out")) == 3
    # A retried finalize writes it again, shorter this time: the old chunks go.
    again = fs.write_file(
        store, 7, "out.jsonl", "batch_output", [b"2" * 5], max_bytes=4 * K, file_id="file-out"
    )
    assert again.bytes == 5 and again.created_at == first.created_at
    assert b"".join(fs.read_chunks(store, "file-out")) == b"22222"
    assert _rows(store) == (1, 1)
    # The same content twice: the same file.
    third = fs.write_file(
        store, 7, "out.jsonl", "batch_output", [b"2" * 5], max_bytes=4 * K, file_id="file-out"
    )
    assert (third.bytes, third.sha256) == (again.bytes, again.sha256) and _rows(store) == (1, 1)
    # A replacement past the bound keeps the old content.
    with pytest.raises(FileTooLarge):
        fs.write_file(store, 7, "o", "batch_output", [b"3" * 9], max_bytes=8, file_id="file-out")
    assert b"".join(fs.read_chunks(store, "file-out")) == b"22222"
    assert _rows(store) == (1, 1)


def test_an_abandoned_write_is_never_served_and_is_purged(store: Store) -> None:
    writer = fs.FileWriter(store, 1, "half", "batch", max_bytes=10 * K)
    writer.write(b"z" * (K + 1))  # one chunk written, then the writer "dies"
    assert fs.get_file(store, 1, writer.file_id) is None
    assert fs.list_files(store, 1) == ([], False)
    assert _rows(store) == (1, 1)
    assert file_upkeep.purge_abandoned(store, older_than=2**31 - 1) == 1
    assert _rows(store) == (0, 0)


def test_pages_ownership_and_delete(store: Store) -> None:
    made = [fs.write_file(store, 1, f"f{i}", "batch", [b"{}"], max_bytes=10) for i in range(5)]
    fs.write_file(store, 2, "other", "batch", [b"{}"], max_bytes=10)
    fs.write_file(store, 1, "res", "batch_output", [b"{}"], max_bytes=10)
    ids = {f.id for f in made}

    for order in ("asc", "desc"):
        seen: list[str] = []
        after = None
        while True:
            page, more = fs.list_files(store, 1, purpose="batch", after=after, limit=2, order=order)
            seen += [f.id for f in page]
            if not more:
                break
            after = page[-1].id
        assert set(seen) == ids and len(seen) == 5
        keys = [(f.created_at, f.id) for f in (fs.get_file(store, 1, i) for i in seen) if f]
        assert keys == sorted(keys, reverse=order == "desc")
    assert len(fs.list_files(store, 1)[0]) == 6  # every purpose

    theirs = fs.list_files(store, 2)[0][0]
    assert fs.get_file(store, 1, theirs.id) is None
    assert not fs.delete_file(store, 1, theirs.id)
    assert fs.get_file(store, 2, theirs.id) is not None

    gone = made[0].id
    assert fs.delete_file(store, 1, gone)
    assert fs.get_file(store, 1, gone) is None
    assert not fs.delete_file(store, 1, gone)
    assert list(fs.read_chunks(store, gone)) == []
    assert gone not in {f.id for f in fs.list_files(store, 1, limit=100)[0]}


def test_a_keys_files_count_until_deleted_or_expired(store: Store) -> None:
    now = 1_000_000
    fs.write_file(store, 1, "a", "batch", [b"x" * 100], max_bytes=1000)
    fs.write_file(store, 1, "b", "batch", [b"x" * 50], max_bytes=1000, expires_at=now + 10)
    gone = fs.write_file(store, 1, "c", "batch", [b"x" * 30], max_bytes=1000)
    fs.write_file(store, 2, "theirs", "batch", [b"x" * 70], max_bytes=1000)
    assert fs.delete_file(store, 1, gone.id)
    assert file_upkeep.key_bytes(store, 1, now) == 150
    assert file_upkeep.key_bytes(store, 1, now + 10) == 100  # b expired
    assert file_upkeep.key_bytes(store, 3, now) == 0


def test_past_the_keys_total_an_upload_leaves_nothing(store: Store) -> None:
    writer = fs.FileWriter(
        store, 1, "big", "batch", max_bytes=10 * K, key_total=2 * K, key_used=K
    )  # fmt: skip
    writer.write(b"x" * K)  # exactly the room left: taken
    with pytest.raises(KeyStorageFull) as refused:
        writer.write(b"x")
    assert (refused.value.limit, refused.value.used) == (2 * K, K)
    assert isinstance(refused.value, FileTooLarge)  # a client sees the same 413 family
    assert _rows(store) == (0, 0)


def test_expired_files_lose_their_content_and_keep_their_row(store: Store) -> None:
    now = 1_000_000
    old = fs.write_file(store, 1, "old", "batch", [b"y" * (K + 1)], max_bytes=2 * K, expires_at=now)
    kept = fs.write_file(store, 1, "kept", "batch", [b"z"], max_bytes=10, expires_at=now + 1)
    forever = fs.write_file(store, 1, "forever", "batch", [b"w"], max_bytes=10)
    assert file_upkeep.purge_expired(store, now) == 1
    assert file_upkeep.purge_expired(store, now) == 0  # done once
    assert list(fs.read_chunks(store, old.id)) == []
    with store.session() as session:
        row = session.get(StoredFile, old.id)
        assert row is not None and row.deleted_at == now and row.bytes == 0
    assert b"".join(fs.read_chunks(store, kept.id)) == b"z"
    assert b"".join(fs.read_chunks(store, forever.id)) == b"w"
    assert not fs.delete_file(store, 1, old.id)  # gone for its key too
