"""The tables behind OpenAI's stateful APIs: Files, Batches and Responses.

In the store (SQLite or PostgreSQL) so that any router and any control worker,
on any host, reaches a file, a batch's progress or a response's events with
nothing new to run. Every row carries the ``key_id`` that made it and every
read filters on it: another key's id is simply not found (a 404, never a 403
that would confirm the id exists).

Times are epoch seconds, as OpenAI's objects give them. JSON columns hold the
OpenAI-shaped pieces (request parameters, output items, errors) as the API
returns them. ``meta`` is OpenAI's ``metadata`` (SQLModel reserves the name).
"""

from typing import Any

from sqlalchemy import JSON, BigInteger, LargeBinary, UniqueConstraint
from sqlmodel import Field, SQLModel

# A file's content is stored in chunks of at most this many bytes, written
# and read one at a time: an upload or a download never holds a whole file.
FILE_CHUNK_BYTES = 1 << 20


class StoredFile(SQLModel, table=True):
    """An uploaded file (``/v1/files``) or a batch's output or error file."""

    __tablename__ = "openai_files"

    id: str = Field(primary_key=True, description="file-…")
    key_id: int = Field(index=True)
    filename: str
    purpose: str = Field(description="batch (uploads), batch_output (results)")
    bytes: int = Field(default=0, sa_type=BigInteger)
    status: str = Field(default="uploading", description="uploading, processed, error")
    created_at: int
    expires_at: int | None = None
    sha256: str = ""
    deleted_at: int | None = None


class FileChunk(SQLModel, table=True):
    """One piece of a file's content, in order of ``idx``."""

    __tablename__ = "openai_file_chunks"

    file_id: str = Field(primary_key=True)
    idx: int = Field(primary_key=True)
    data: bytes = Field(sa_type=LargeBinary)


class BatchRecord(SQLModel, table=True):
    """A batch (``/v1/batches``): its request, status, timestamps and counts.

    ``completed`` and ``failed`` move in the same transaction as the line's
    ``BatchResult`` insert, so ``request_counts`` is exact after any crash.
    """

    __tablename__ = "openai_batches"

    id: str = Field(primary_key=True, description="batch_…")
    key_id: int = Field(index=True)
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    status: str = "validating"
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = Field(default=None, sa_type=JSON)
    meta: dict[str, str] | None = Field(default=None, sa_type=JSON)
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = Field(default=0, sa_type=BigInteger)
    output_tokens: int = Field(default=0, sa_type=BigInteger)
    # When a workflow was started for it (the sweeper starts those without).
    started_at: int | None = None


class BatchLine(SQLModel, table=True):
    """One validated input line, copied from the input file at validation (so
    deleting the input file later loses nothing)."""

    __tablename__ = "openai_batch_lines"
    __table_args__ = (UniqueConstraint("batch_id", "custom_id"),)

    batch_id: str = Field(primary_key=True)
    line: int = Field(primary_key=True, description="1-based line number in the input file")
    custom_id: str
    body: dict[str, Any] = Field(sa_type=JSON)


class BatchResult(SQLModel, table=True):
    """One line's outcome: written once per ``(batch, custom_id)``, ever; a
    retried chunk finds it and neither runs nor bills the line again."""

    __tablename__ = "openai_batch_results"

    batch_id: str = Field(primary_key=True)
    custom_id: str = Field(primary_key=True)
    line: int
    ok: bool
    status_code: int = 0
    request_id: str = ""
    body: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    error: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    created_at: int


class ResponseRecord(SQLModel, table=True):
    """A response (``/v1/responses``): its request, state and final output."""

    __tablename__ = "openai_responses"

    id: str = Field(primary_key=True, description="resp_…")
    key_id: int = Field(index=True)
    model: str
    status: str = Field(description="queued, in_progress, completed, failed, cancelled, incomplete")
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    request: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    output: list[dict[str, Any]] = Field(default_factory=list, sa_type=JSON)
    usage: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    error: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    incomplete_details: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    created_at: int
    completed_at: int | None = None
    cancel_requested_at: int | None = None
    deleted_at: int | None = None
    # The highest sequence number among its stored events (-1: none yet).
    last_seq: int = -1
    # Set in the transaction that bills its usage: billed once, whoever retries.
    billed_at: int | None = None
    started_at: int | None = None
    # What it holds in the store (its request, input items and output, as
    # JSON): the per-key bound sums it (router/responses/bounds.py).
    stored_bytes: int = Field(default=0, sa_type=BigInteger)
    # Calls of the router's run endpoint for it: the run's attempts, bounded.
    run_attempts: int = 0


class ResponseInputItem(SQLModel, table=True):
    """One input item of a response, in order: for ``input_items`` and for
    rebuilding a conversation from ``previous_response_id``."""

    __tablename__ = "openai_response_input_items"

    response_id: str = Field(primary_key=True)
    idx: int = Field(primary_key=True)
    item_id: str
    item: dict[str, Any] = Field(sa_type=JSON)


class ResponseEventChunk(SQLModel, table=True):
    """The stream events of a background response, a flush at a time: every
    event with ``first_seq <= sequence_number <= last_seq``, in order."""

    __tablename__ = "openai_response_events"

    response_id: str = Field(primary_key=True)
    first_seq: int = Field(primary_key=True)
    last_seq: int
    events: list[dict[str, Any]] = Field(sa_type=JSON)
