"""Batch rows in the store, and the Batch object a client gets for one.

Every read and write names the key: another key's batch is simply not found
(a 404, never a 403 that would confirm the id exists). Synchronous (SQLModel
sessions): async callers run these in a thread, bounded by the store wait.
"""

import re
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, or_, update
from sqlmodel import col, select

from llmgw.store import Store
from llmgw.store.openai_tables import BatchRecord

# OpenAI's one completion window; expires_at is created_at plus this.
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
# A batch in these may be cancelled (it goes to ``cancelling``).
CANCELLABLE = ("validating", "in_progress")
# Cancelling these again answers them unchanged: the cancel is under way or done.
CANCELLED = ("cancelling", "cancelled")


def batch_id() -> str:
    """A batch's id: ``batch_`` and 32 hex digits (OpenAI's shape)."""
    return f"batch_{secrets.token_hex(16)}"


# What every batch id looks like (``batch_id``; base62, as tests and other
# stores' ids may be, not only hex).
_BATCH_ID = re.compile(r"batch_[0-9A-Za-z]{1,64}")


def is_batch_id(text: str) -> bool:
    """Whether ``text`` has a batch id's shape. Text without it names no
    batch and is never sent to the store: PostgreSQL refuses a NUL in a text
    parameter with an error, not an empty answer, which the request path
    reads as the store failing (a 503 for a client's made-up id)."""
    return _BATCH_ID.fullmatch(text) is not None


def batch_object(record: BatchRecord) -> dict[str, Any]:
    """The Batch object (OpenAI's shape) of a stored batch: every field, the
    absent ones as null."""
    errors = None if record.errors is None else {"object": "list", "data": record.errors}
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": None,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": record.total,
            "completed": record.completed,
            "failed": record.failed,
        },
        "usage": {
            "input_tokens": record.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": record.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record.input_tokens + record.output_tokens,
        },
        "metadata": record.meta,
    }


def insert_batch(store: Store, record: BatchRecord) -> None:
    """Store a new batch (one row: a create is never retried into a second)."""
    with store.session() as session:
        session.add(record)
        session.commit()
        session.refresh(record)
        session.expunge(record)


def get_batch(store: Store, key_id: int | None, batch_id: str) -> BatchRecord | None:
    """The batch, or None when there is none for this key (``key_id`` None:
    any key's, for the executor's and the admin's views)."""
    if not is_batch_id(batch_id):
        return None
    with store.session() as session:
        record = session.get(BatchRecord, batch_id)
        if record is None or (key_id is not None and record.key_id != key_id):
            return None
        session.expunge(record)
        return record


def list_batches(
    store: Store, key_id: int | None, *, after: str | None = None, limit: int = 20
) -> tuple[list[BatchRecord], bool]:
    """A page of batches, newest first, and whether more follow. ``after``
    is the last id of the page before (one of this key's; another key's or
    an unknown id gives an empty page). ``key_id`` None: every key's."""
    if after is not None and not is_batch_id(after):
        return [], False  # no batch's id: an unknown one
    query = select(BatchRecord)
    if key_id is not None:
        query = query.where(BatchRecord.key_id == key_id)
    with store.session() as session:
        if after is not None:
            last = session.get(BatchRecord, after)
            if last is None or (key_id is not None and last.key_id != key_id):
                return [], False
            query = query.where(
                or_(
                    col(BatchRecord.created_at) < last.created_at,
                    and_(
                        col(BatchRecord.created_at) == last.created_at,
                        col(BatchRecord.id) < last.id,
                    ),
                )
            )
        query = query.order_by(col(BatchRecord.created_at).desc(), col(BatchRecord.id).desc())
        rows = list(session.exec(query.limit(limit + 1)).all())
        for row in rows:
            session.expunge(row)
    return rows[:limit], len(rows) > limit


@dataclass(frozen=True)
class Cancel:
    """What a cancel found: the batch after it, and whether it moved it to
    ``cancelling`` now (then the executor is signalled)."""

    record: BatchRecord
    moved: bool


def cancel_batch(store: Store, key_id: int, batch_id: str, now: int) -> Cancel | None:
    """Move a running batch to ``cancelling`` (one conditional UPDATE: the
    executor changing its status at the same moment cannot be overwritten);
    None when there is no such batch for this key. A batch in any other
    status comes back unchanged, ``moved`` false."""
    if not is_batch_id(batch_id):
        return None
    with store.session() as session:
        result = session.execute(
            update(BatchRecord)
            .where(
                and_(
                    col(BatchRecord.id) == batch_id,
                    col(BatchRecord.key_id) == key_id,
                    col(BatchRecord.status).in_(CANCELLABLE),
                )
            )
            .values(status="cancelling", cancelling_at=now)
        )
        session.commit()
        moved = bool(getattr(result, "rowcount", 0))
    record = get_batch(store, key_id, batch_id)
    return None if record is None else Cancel(record, moved)
