"""Files and Batches within bounds (issue 34): a stalled store answers 503,
form fields are capped, and splitting a file into lines is linear."""

import asyncio

import httpx
import openai
import psycopg

from llmgw.store import files as fs
from router.api import files as files_api
from tests.gateway.test_files import router
from tests.gateway.test_files_store_frozen import own_pg  # noqa: F401  (fixture)
from tests.pg import PgCluster


async def test_a_stalled_store_answers_batches_with_503(own_pg: PgCluster) -> None:  # noqa: F811
    """A batches store call held by a lock past the router's bound is a
    503 ``store_unavailable`` in the OpenAI format, not a 500."""
    store_url = own_pg.create_database()
    async with router(store_url, store_wait_s=1.0) as r:
        client = r.client(r.key())
        await client.batches.list()  # the key is read (and cached) before the stall
        with psycopg.connect(store_url) as holder:
            holder.execute("LOCK TABLE openai_batches IN ACCESS EXCLUSIVE MODE")
            try:
                for call in (client.batches.list(), client.batches.retrieve("batch_x")):
                    try:
                        async with asyncio.timeout(30):
                            await call
                    except openai.APIStatusError as exc:
                        assert exc.status_code == 503, exc.response.text
                        assert exc.response.json()["error"]["code"] == "store_unavailable"
                    else:
                        raise AssertionError("answered while the store stalled")
            finally:
                holder.rollback()


def _fields_body(count: int, boundary: bytes = b"xyz") -> bytes:
    head = b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n'
    parts = [head % (boundary, b"purpose", b"batch")]
    parts += [head % (boundary, b"f%d" % i, b"v") for i in range(count)]
    return b"".join(parts)


async def test_form_fields_are_counted_and_capped(store_url: str) -> None:
    """A flood of small non-file fields is refused with a 400 once past the
    cap, while the body still arrives (it is not read to its end)."""
    async with router(store_url) as r:
        key = r.key()
        body = _fields_body(files_api.MAX_FIELDS * 50)
        async with httpx.AsyncClient(base_url=r.base, timeout=30) as http:
            answer = await http.post(
                "/v1/files",
                content=body,
                headers={
                    "Authorization": f"Bearer {key}",
                    "Content-Type": "multipart/form-data; boundary=xyz",
                },
            )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "fields" in error["message"], error


class _Counted(bytes):
    """A chunk that counts the bytes each operation on it goes through."""

    work = 0

    def __radd__(self, other: bytes) -> "_Counted":
        _Counted.work += len(other) + len(self)
        return _Counted(bytes(other) + bytes(self))

    def __add__(self, other: bytes) -> "_Counted":  # type: ignore[override]
        _Counted.work += len(other) + len(self)
        return _Counted(bytes(self) + bytes(other))

    def split(self, sep: bytes | None = None, maxsplit: int = -1) -> list[bytes]:  # type: ignore[override]
        _Counted.work += len(self)
        return bytes(self).split(sep, maxsplit)


def test_splitting_a_long_line_is_linear() -> None:
    """One line over many chunks: the splitter's work grows with the input,
    not with its square (the old split re-joined the whole line so far to
    every chunk: 64 MiB took 1.6 s)."""
    chunk, chunks = 1024, 512
    data = [_Counted(b"x" * chunk) for _ in range(chunks)] + [_Counted(b"\nend")]
    _Counted.work = 0
    lines = list(fs.split_lines(data))
    assert [n for n, _ in lines] == [1, 2]
    assert len(lines[0][1]) == chunk * chunks and lines[1][1] == b"end"
    assert _Counted.work <= 4 * chunk * chunks, _Counted.work
