"""OpenAI's Files API (``/v1/files``): upload, list, retrieve, content, delete.

An upload is parsed as it arrives (python-multipart's push parser over
``request.stream()``) and written to the store a chunk at a time
(llmgw/store/files.py): the router holds at most about two chunks of a file,
never the whole body. Past ``LLMGW_MAX_FILE_BYTES``, or past what the key's
files may hold in all (``LLMGW_MAX_KEY_FILE_BYTES``, llmgw/store/file_upkeep.py),
the upload is refused with a 413 and what was written of it is removed. The
key's total is checked as each chunk is written, under the key's lock, its
chunks counted as they commit: uploads of one key in parallel stay within it
together. Every
store call of an upload is bounded (``LLMGW_STORE_WAIT_S``): a store that
does not answer in time gets a 503, and what the upload wrote is removed once
the store answers again (``_Writing``). Content is streamed back a
chunk row at a time. Files live in the store, so every router and the
control worker reach them; a file is its key's: another key's id is a 404,
the same as an unknown one.

Only ``purpose=batch`` is taken: files are here to feed ``/v1/batches``.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from llmgw.errors import FileTooLarge, KeyStorageFull, StoreError
from llmgw.store import file_upkeep
from llmgw.store import files as fs
from llmgw.store.openai_tables import FILE_CHUNK_BYTES, StoredFile
from router.api.deps import Deps, get_deps
from router.api.openai import CallerDep
from router.api.openapi_docs import error_responses
from router.common.blocking import within
from router.common.errors import ErrorKind, invalid_fields

T = TypeVar("T")

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["files"])
DepsDep = Annotated[Deps, Depends(get_deps)]

PURPOSES = ("batch",)
# A form field other than the file is a few bytes: more is refused.
MAX_FIELD_BYTES = 1024
# Form fields (parts other than the file) one upload may hold: a form needs
# a handful (purpose, expires_after[...]); a flood of them is refused as it
# arrives, not kept in memory until the body timeout.
MAX_FIELDS = 16
# OpenAI's bounds on expires_after[seconds] (one hour to 30 days).
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 86400


class FileObject(BaseModel):
    """A file, as OpenAI's ``FileObject``."""

    id: str = Field(description="file-…")
    object: Literal["file"] = "file"
    bytes: int = Field(description="The size of the file's content.")
    created_at: int = Field(description="Epoch seconds.")
    expires_at: int | None = Field(default=None, description="Epoch seconds; null: never.")
    filename: str
    purpose: str = Field(description="batch (uploads) or batch_output (a batch's results)")
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None


class FileList(BaseModel):
    """A page of files (OpenAI's cursor page: the next one is ``after=last_id``)."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    """What deleting a file answers."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool


def file_object(row: StoredFile) -> FileObject:
    """The OpenAI object of a stored file."""
    return FileObject(
        id=row.id,
        bytes=row.bytes,
        created_at=row.created_at,
        expires_at=row.expires_at,
        filename=row.filename,
        purpose=row.purpose,
        status="processed",
    )


async def _store(deps: Deps, fn: Callable[[], T]) -> T:
    """A store call on a request's path, bounded as every such call is."""
    try:
        return await within(deps.store_wait_s, fn)
    except StoreError as exc:
        raise ErrorKind.STORE_UNAVAILABLE.error() from exc


async def _owned(deps: Deps, key_id: int, file_id: str) -> StoredFile:
    # Text without a file id's shape is no file: a 404 without the store (a
    # store that is slow to answer would make it a 503).
    row = None
    if fs.is_file_id(file_id):
        row = await _store(deps, lambda: fs.get_file(deps.store, key_id, file_id))
    if row is None:
        raise ErrorKind.FILE_NOT_FOUND.error(file_id=file_id)
    return row


class _Upload:
    """The multipart body's parts as the push parser finds them: small fields
    kept, the ``file`` part's bytes handed out as they come (``take``)."""

    def __init__(self) -> None:
        self.fields: dict[str, bytes] = {}
        self.filename: str | None = None
        self.ended = False
        self.problem: str | None = None
        self._pending = bytearray()
        self._name: str | None = None
        self._header = b""
        self._value = b""
        self._disposition = b""
        self._value_parts: list[bytes] = []
        self._field_count = 0

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._part_begin,
            "on_part_data": self._part_data,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._name = None
        self._disposition = b""
        self._header = b""
        self._value = b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header = b""
        self._value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        self._name = name.decode("utf-8", "replace") if name is not None else None
        if self._name == "file":
            if self.filename is not None:
                self.problem = "file: only one file per upload"
            raw = options.get(b"filename")
            self.filename = raw.decode("utf-8", "replace") if raw else "upload"
        elif self._name is not None:
            self._field_count += 1
            if self._field_count > MAX_FIELDS:
                self.problem = f"fields: more than {MAX_FIELDS} form fields"
                self._name = None
                return
            self.fields[self._name] = b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "file":
            self._pending += data[start:end]
        elif self._name is not None:
            value = self.fields[self._name] + data[start:end]
            if len(value) > MAX_FIELD_BYTES:
                self.problem = f"{self._name}: longer than {MAX_FIELD_BYTES} bytes"
            else:
                self.fields[self._name] = value

    def _end(self) -> None:
        self.ended = True

    def take(self) -> bytes:
        """The file's bytes parsed since the last call."""
        data = bytes(self._pending)
        self._pending.clear()
        return data

    @property
    def pending(self) -> int:
        return len(self._pending)


def _boundary(request: Request) -> bytes:
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise invalid_fields(
            ["the body must be multipart/form-data with the fields `purpose` and `file`"], "file"
        )
    return boundary


def _purpose(upload: _Upload) -> str:
    raw = upload.fields.get("purpose")
    if raw is None:
        raise invalid_fields(["purpose: required"], "purpose")
    purpose = raw.decode("utf-8", "replace")
    if purpose not in PURPOSES:
        raise invalid_fields(
            [f"purpose: {purpose!r} is not supported; llmgw takes files with purpose 'batch'"],
            "purpose",
        )
    return purpose


def _expires_at(upload: _Upload, now: int) -> int | None:
    anchor = upload.fields.get("expires_after[anchor]")
    seconds = upload.fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != b"created_at" or seconds is None or not seconds.isdigit():
        raise invalid_fields(
            ["expires_after: anchor must be 'created_at' and seconds an integer"],
            "expires_after",
        )
    if not EXPIRES_MIN_S <= int(seconds) <= EXPIRES_MAX_S:
        raise invalid_fields(
            [f"expires_after.seconds: between {EXPIRES_MIN_S} and {EXPIRES_MAX_S}"],
            "expires_after",
        )
    return now + int(seconds)


_UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"type": "string", "enum": list(PURPOSES)},
                },
            }
        }
    },
}


@router.post(
    "/files",
    response_model=FileObject,
    openapi_extra={"requestBody": _UPLOAD_BODY},
    responses=error_responses(
        {
            400: "Not a multipart body with `purpose` (batch) and `file`",
            413: "The file is larger than LLMGW_MAX_FILE_BYTES (`file_too_large`), or the key's"
            " files would hold more than LLMGW_MAX_KEY_FILE_BYTES (`file_storage_full`);"
            " nothing stored",
        }
    ),
)
async def create_file(request: Request, deps: DepsDep, caller: CallerDep) -> FileObject:
    """Upload a file (multipart: ``purpose=batch`` and ``file``), streamed into
    the store as it arrives."""
    upload = _Upload()
    parser = MultipartParser(_boundary(request), upload.callbacks())  # type: ignore[arg-type]
    writing: _Writing | None = None
    try:
        async for data in request.stream():
            try:
                parser.write(data)
            except MultipartParseError as exc:
                raise invalid_fields(
                    [f"file: not a valid multipart body ({exc})"], "file"
                ) from None
            if upload.problem:
                raise invalid_fields([upload.problem], upload.problem.split(":")[0])
            if upload.pending >= FILE_CHUNK_BYTES:
                if writing is None:
                    writing = _Writing(deps, await _writer(deps, caller.key_id, upload))
                await writing.write(upload.take())
        parser.finalize()
        if not upload.ended:
            raise invalid_fields(["file: the multipart body ended early"], "file")
        if upload.filename is None:
            raise invalid_fields(["file: required"], "file")
        purpose = _purpose(upload)
        now = int(time.time())
        expires_at = _expires_at(upload, now)
        if writing is None:
            writing = _Writing(deps, await _writer(deps, caller.key_id, upload))
        await writing.write(upload.take())
        writing.writer.purpose = purpose
        writing.writer.expires_at = expires_at
        row = await writing.finish()
        writing = None
    except ClientDisconnect:
        raise ErrorKind.CLIENT_GONE.error() from None
    finally:
        if writing is not None:
            await writing.discard()
    return file_object(row)


async def _writer(deps: Deps, key_id: int, upload: _Upload) -> fs.FileWriter:
    # A purpose that came before the file is checked before anything is written.
    if "purpose" in upload.fields:
        _purpose(upload)
    raw = upload.fields.get("purpose", b"")
    now = int(time.time())
    used = await _store(deps, lambda: file_upkeep.key_bytes(deps.store, key_id, now))
    return fs.FileWriter(
        deps.store,
        key_id,
        upload.filename or "upload",
        raw.decode("utf-8", "replace"),
        max_bytes=deps.max_file_bytes,
        key_total=deps.max_key_file_bytes,
        key_used=used,
    )


class _Writing:
    """An upload's writer, each of its store calls in a thread and bounded as
    every store call on a request's path is. A call past the bound answers
    503 and keeps its thread (a frozen store holds it until it answers): the
    writer, not thread-safe, is discarded once that call has ended, so an
    upload answered with an error keeps nothing, not even a file its late
    ``finish`` made (tests/gateway/test_files_store_frozen.py)."""

    def __init__(self, deps: Deps, writer: fs.FileWriter) -> None:
        self.writer = writer
        self._wait = deps.store_wait_s
        self._stuck = False

    async def write(self, data: bytes) -> None:
        await self._bounded(lambda: self.writer.write(data))

    async def finish(self) -> StoredFile:
        # Its last chunk is checked against the key's total too.
        return await self._bounded(self.writer.finish)

    async def _bounded(self, fn: Callable[[], T]) -> T:
        try:
            return await self._call(fn)
        except KeyStorageFull as exc:
            raise ErrorKind.KEY_STORAGE_FULL.error(limit=exc.limit, used=exc.used) from None
        except FileTooLarge as exc:
            raise ErrorKind.FILE_TOO_LARGE.error(limit=exc.limit) from None

    async def discard(self) -> None:
        """Remove what was written: now, or (a call still stuck) once it ends."""
        if not self._stuck:
            # Past the bound its thread goes on; failing, purge_abandoned's to do.
            with contextlib.suppress(StoreError):
                await within(self._wait, self.writer.discard)

    async def _call(self, fn: Callable[[], T]) -> T:
        work = asyncio.ensure_future(asyncio.to_thread(fn))
        try:
            async with asyncio.timeout(self._wait):
                return await asyncio.shield(work)
        except TimeoutError:
            self._stuck = True
            work.add_done_callback(self._discard_late)
            raise ErrorKind.STORE_UNAVAILABLE.error() from None
        except StoreError as exc:
            raise ErrorKind.STORE_UNAVAILABLE.error() from exc

    def _discard_late(self, work: "asyncio.Future[Any]") -> None:
        if not work.cancelled():
            work.exception()  # the late call's own failure: nobody's to raise now
        late = asyncio.get_running_loop().run_in_executor(None, self.writer.discard)
        late.add_done_callback(_late_discard_done)


def _late_discard_done(late: "asyncio.Future[None]") -> None:
    if not late.cancelled() and (exc := late.exception()) is not None:
        log.warning("an upload answered 503 could not be removed yet: %s", exc)


@router.get("/files", response_model=FileList, responses=error_responses({}))
async def list_files(
    deps: DepsDep,
    caller: CallerDep,
    purpose: str | None = None,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    """The key's files, newest first (``order=asc``: oldest first)."""
    rows, more = await _store(
        deps,
        lambda: fs.list_files(
            deps.store, caller.key_id, purpose=purpose, after=after, limit=limit, order=order
        ),
    )
    data = [file_object(r) for r in rows]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=more,
    )


_NOT_FOUND = error_responses({404: "No such file (or it is another key's)"})


@router.get("/files/{file_id}", response_model=FileObject, responses=_NOT_FOUND)
async def retrieve_file(file_id: str, deps: DepsDep, caller: CallerDep) -> FileObject:
    """A file's description."""
    return file_object(await _owned(deps, caller.key_id, file_id))


@router.get(
    "/files/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The file's content",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        },
        **_NOT_FOUND,
    },
)
async def file_content(file_id: str, deps: DepsDep, caller: CallerDep) -> StreamingResponse:
    """A file's content, streamed from the store a chunk at a time."""
    row = await _owned(deps, caller.key_id, file_id)
    return StreamingResponse(
        fs.read_chunks(deps.store, row.id),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{_quoted(row.filename)}"'},
    )


def _quoted(name: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name)


@router.delete("/files/{file_id}", response_model=FileDeleted, responses=_NOT_FOUND)
async def delete_file(file_id: str, deps: DepsDep, caller: CallerDep) -> FileDeleted:
    """Delete a file and its content (a batch that read it keeps its lines)."""
    if not fs.is_file_id(file_id) or not await _store(
        deps, lambda: fs.delete_file(deps.store, caller.key_id, file_id)
    ):
        raise ErrorKind.FILE_NOT_FOUND.error(file_id=file_id)
    return FileDeleted(id=file_id, deleted=True)
