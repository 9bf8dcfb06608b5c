"""llmgw/store/files.py on SQLite and a real PostgreSQL: content re-cut into
chunks and read back a chunk at a time, lines that span chunks, the size
bound leaving nothing behind, replacing a file's content idempotently,
keyset pages, ownership and deletion."""

from collections.abc import Iterator

import pytest
from sqlmodel import col, func, select

from llmgw.errors import FileTooLarge
from llmgw.store import Store
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
    assert fs.purge_abandoned(store, older_than=2**31 - 1) == 1
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
