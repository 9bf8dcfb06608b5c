"""Durable OpenAI jobs (batches, background responses): the workflows' and
activities' inputs and results, on the ``exec`` task queue.

Line results never cross Temporal: they live in the store (BatchResult), so a
batch's history holds only ranges and counts whatever its size.
"""

from enum import StrEnum

from pydantic import BaseModel, Field


class BatchStatus(StrEnum):
    """OpenAI's batch statuses."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL_BATCH = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


class BatchRun(BaseModel):
    """A batch's workflow input, the same through every continue-as-new."""

    batch_id: str
    expires_at: float = Field(description="epoch seconds: the completion window's end")
    # Where a continued run resumes (progress itself lives in the store).
    validated: bool = False
    next_line: int = Field(default=1, ge=1, description="the first line not yet scheduled")
    total: int = 0
    cancelled: bool = False
    # Lines recorded by earlier runs (the memo's progress; the store is exact).
    completed: int = 0
    failed: int = 0
    chunk_lines: int = Field(default=100, ge=1)
    parallel_chunks: int = Field(default=4, ge=1)
    line_concurrency: int = Field(default=8, ge=1, description="lines in flight per chunk")
    # Chunks finished in this run (continue-as-new past ``max_chunks_per_run``).
    max_chunks_per_run: int = Field(default=200, ge=1)


class BatchRunResult(BaseModel):
    status: BatchStatus
    completed: int = 0
    failed: int = 0


class BatchId(BaseModel):
    batch_id: str


class BatchLineError(BaseModel):
    """One entry of a batch's ``errors.data``."""

    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchValidation(BaseModel):
    """The router's answer to ``POST /internal/batches/{id}/validate``."""

    total: int = 0
    errors: list[BatchLineError] = Field(default_factory=list)


class BatchStatusChange(BaseModel):
    """Move a batch to ``status`` (its ``<status>_at`` set once), unless it is
    terminal already; ``errors`` for ``failed``."""

    batch_id: str
    status: BatchStatus
    errors: list[BatchLineError] | None = None


class BatchState(BaseModel):
    """A batch's row as the workflow needs it after a status change."""

    status: BatchStatus
    total: int = 0
    completed: int = 0
    failed: int = 0
    key_id: int = 0


class ChunkRange(BaseModel):
    """Lines ``first_line..last_line`` (1-based, inclusive) of a batch."""

    batch_id: str
    first_line: int = Field(ge=1)
    last_line: int = Field(ge=1)
    line_concurrency: int = Field(default=8, ge=1)


class ChunkResult(BaseModel):
    """What a chunk's run recorded (lines found done already are not counted)."""

    completed: int = 0
    failed: int = 0
    skipped: int = 0


class FinalizeBatch(BaseModel):
    """Write the output and error files; lines that never ran go to the error
    file with ``never_ran_code`` (batch_expired, batch_cancelled)."""

    batch_id: str
    never_ran_code: str = ""


class Finalized(BaseModel):
    output_file_id: str | None = None
    error_file_id: str | None = None


class CancelJob(BaseModel):
    """The cancel signal's input (batches and background responses)."""

    reason: str = ""


class ResponseRun(BaseModel):
    response_id: str


class ResponseRunResult(BaseModel):
    status: str = ""
    last_seq: int = -1


class BatchMemo(BaseModel):
    """A batch's progress as the Temporal UI shows it (memo ``batch``)."""

    status: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    key_id: int = 0
