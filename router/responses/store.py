"""Responses in the store: the rows behind ``/v1/responses`` and its background runs.

Every read and write names the key: another key's response is simply not
found (a 404, never a 403 that would confirm the id exists). Synchronous
(SQLModel sessions): async callers run these in a thread, bounded by the
store wait (router/common/blocking.py).

A response row keeps, in ``request``:

- ``response``: the Response object as created (every field the client
  reads; status, output, usage... are columns of their own);
- ``chat``: the chat-completions body it was translated to, the
  conversation of its ``previous_response_id`` chain included, so a
  background run (on any router, after any restart) needs nothing else;
- ``root``: its conversation's first response (router/responses/chain.py);
- ``reservation``: a background response's quota, taken at its creation
  (router/api/response_quota.py).

``stored_bytes`` is what the row holds, summed for the key's bound
(router/responses/bounds.py).
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select
from sqlmodel.sql.expression import SelectOfScalar

from llmgw.errors import LlmgwError
from llmgw.store import Store
from llmgw.store.file_upkeep import lock_key_files
from llmgw.store.openai_tables import ResponseEventChunk, ResponseInputItem, ResponseRecord
from llmgw.store.usage import add_usage
from router.billing.usage import day_of
from router.responses import ids
from router.responses.bounds import size_of
from router.responses.request import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    Item,
    MessageItem,
    OutputText,
    Refusal,
)

TERMINAL = frozenset({"completed", "failed", "cancelled", "incomplete"})
RUNNING = ("queued", "in_progress")
_TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def response_object(record: ResponseRecord) -> dict[str, Any]:
    """The Response object a client gets for ``record``."""
    base = dict(record.request.get("response") or {})
    base.update(
        id=record.id,
        status=record.status,
        output=record.output,
        usage=record.usage,
        error=record.error,
        incomplete_details=record.incomplete_details,
        completed_at=record.completed_at,
    )
    return base


def _part(part: ContentPart, role: str) -> dict[str, Any]:
    if isinstance(part, InputImage):
        return {"type": "input_image", "image_url": part.image_url, "detail": part.detail or "auto"}
    if isinstance(part, Refusal):
        return {"type": "refusal", "refusal": part.refusal}
    text = part.text if isinstance(part, InputText | OutputText) else ""
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def stored_item(item: Item) -> dict[str, Any]:
    """An input item as ``input_items`` lists it: with an id (given one when
    the client sent none) and a status, as OpenAI's item types require."""
    if isinstance(item, MessageItem):
        parts = (
            [_part(InputText(type="input_text", text=item.content), item.role)]
            if isinstance(item.content, str)
            else [_part(p, item.role) for p in item.content]
        )
        return {
            "id": item.id or ids.message_id(),
            "type": "message",
            "role": item.role,
            "status": item.status or "completed",
            "content": parts,
        }
    if isinstance(item, FunctionCallItem):
        return {
            "id": item.id or ids.function_call_id(),
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": item.status or "completed",
        }
    assert isinstance(item, FunctionCallOutputItem)
    output = (
        item.output
        if isinstance(item.output, str)
        else [_part(p, "user") for p in item.output if not isinstance(p, InputImage)]
    )
    return {
        "id": item.id or ids.function_call_output_id(),
        "type": "function_call_output",
        "call_id": item.call_id,
        "output": output,
        "status": item.status or "completed",
    }


@dataclass
class NewResponse:
    """A response to store: its row and its input items (already given ids)."""

    record: ResponseRecord
    items: list[dict[str, Any]]
    # A background response's first events (created, queued).
    events: Sequence[dict[str, Any]] = ()


class KeyStorageFull(LlmgwError):
    """The key's stored responses would hold more than its bound."""

    def __init__(self, used: int) -> None:
        super().__init__(f"{used} bytes in use")
        self.used = used


def stored_size(new: NewResponse) -> int:
    """What ``new`` holds in the store as created: its request (the
    conversation of its chain included) and its input items."""
    return size_of(new.record.request) + sum(size_of(item) for item in new.items)


def _key_bytes_of(key_id: int) -> SelectOfScalar[int]:
    """What the key's live stored responses hold (a deleted one stops counting)."""
    return select(func.coalesce(func.sum(ResponseRecord.stored_bytes), 0)).where(
        ResponseRecord.key_id == key_id, col(ResponseRecord.deleted_at).is_(None)
    )


def key_bytes(store: Store, key_id: int) -> int:
    """What the key's live stored responses hold (the early check of a
    foreground response, before it is generated: ``insert_response``'s is
    the one that holds)."""
    with store.session() as session:
        return int(session.exec(_key_bytes_of(key_id)).one())


def insert_response(
    store: Store,
    new: NewResponse,
    final: dict[str, Any] | None = None,
    key_limit: int | None = None,
) -> None:
    """The row (in its ``final`` state, given one: a foreground response is
    stored once it has ended), its input items and first events, in one
    transaction: a reader never sees part of it. With ``key_limit``,
    KeyStorageFull (nothing written) when the key's responses would hold
    more than that.

    The check and the insert are one step per key, under the key's lock
    (the one its files take, llmgw/store/file_upkeep.py: PostgreSQL's
    advisory lock of the key; SQLite's write lock, the row's insert first):
    counted in one transaction and inserted in another, N parallel
    creations each passed on what the others had not stored yet and
    overshot the bound by N - 1 responses."""
    if final is not None:
        _final(new.record, final)
    new.record.stored_bytes = stored_size(new) + size_of(new.record.output)
    with store.session() as session:
        if key_limit is not None:
            lock_key_files(session, new.record.key_id)
        # The row first: SQLite's write lock from the transaction's start.
        session.add(new.record)
        session.flush()
        if key_limit is not None:
            used = int(session.exec(_key_bytes_of(new.record.key_id)).one())
            if used > key_limit:
                session.rollback()
                raise KeyStorageFull(used - new.record.stored_bytes)
        for idx, item in enumerate(new.items):
            session.add(
                ResponseInputItem(response_id=new.record.id, idx=idx, item_id=item["id"], item=item)
            )
        if new.events:
            session.add(
                ResponseEventChunk(
                    response_id=new.record.id,
                    first_seq=new.events[0]["sequence_number"],
                    last_seq=new.events[-1]["sequence_number"],
                    events=list(new.events),
                )
            )
        session.commit()
        session.refresh(new.record)
        session.expunge(new.record)


def begin_attempt(store: Store, response_id: str) -> tuple[int, str]:
    """Count one more attempt at a background run: which one this is
    (1-based) and the response's status then. A status no longer running
    (cancelled before it began) means the run must not generate; otherwise
    the first attempt takes the creation's reservation, and a cancel after
    this (which sees ``run_attempts`` above 0) leaves it to the run."""
    with store.session() as session:
        session.execute(
            update(ResponseRecord)
            .where(col(ResponseRecord.id) == response_id)
            .values(run_attempts=col(ResponseRecord.run_attempts) + 1)
        )
        attempts, status = session.exec(
            select(ResponseRecord.run_attempts, ResponseRecord.status).where(
                ResponseRecord.id == response_id
            )
        ).one()
        session.commit()
    return int(attempts), str(status)


def get_response(store: Store, key_id: int | None, response_id: str) -> ResponseRecord | None:
    """The key's response (None: missing, deleted or another key's); any
    key's with ``key_id`` None (the executor's run, which acts as its key)."""
    if not ids.is_response_id(response_id):
        return None
    with store.session() as session:
        record = session.get(ResponseRecord, response_id)
        if record is None or record.deleted_at is not None:
            return None
        if key_id is not None and record.key_id != key_id:
            return None
        session.expunge(record)
        return record


def list_input_items(
    store: Store,
    key_id: int,
    response_id: str,
    *,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> tuple[list[dict[str, Any]], bool] | None:
    """A page of the response's input items and whether more follow (None:
    no such response for this key). ``after`` is an item id of the page before."""
    if get_response(store, key_id, response_id) is None:
        return None
    with store.session() as session:
        rows = list(
            session.exec(
                select(ResponseInputItem)
                .where(ResponseInputItem.response_id == response_id)
                .order_by(col(ResponseInputItem.idx))
            ).all()
        )
    if order == "desc":
        rows.reverse()
    if after is not None:
        at = next((i for i, r in enumerate(rows) if r.item_id == after), None)
        rows = rows[at + 1 :] if at is not None else []
    return [r.item for r in rows[:limit]], len(rows) > limit


@dataclass
class Stopped:
    """A response as a cancel (or delete) left it, and the reservation taken
    at its creation when that call stopped it before any run took it: the
    caller gives it back (router/api/response_quota.py), no one else will."""

    record: ResponseRecord
    reservation: dict[str, int] | None = None


def _stop(session: Session, key_id: int, response_id: str, now: int, background: bool) -> bool:
    """Mark the key's response cancelled if it is still running; whether
    this call did. One conditional UPDATE, the transaction's first statement:
    it holds the row (PostgreSQL) or the database (SQLite) against the run's
    ``begin_attempt`` until the commit, so the two see each other in one
    order and exactly one of them takes the reservation."""
    stop = (
        update(ResponseRecord)
        .where(
            col(ResponseRecord.id) == response_id,
            col(ResponseRecord.key_id) == key_id,
            col(ResponseRecord.deleted_at).is_(None),
            col(ResponseRecord.status).in_(RUNNING),
        )
        .values(
            status="cancelled",
            cancel_requested_at=func.coalesce(col(ResponseRecord.cancel_requested_at), now),
        )
    )
    if background:
        stop = stop.where(col(ResponseRecord.background).is_(True))
    return bool(session.execute(stop).rowcount)  # type: ignore[attr-defined]


def _stopped(record: ResponseRecord, stopped: bool) -> Stopped:
    held = record.request.get("reservation") if stopped and record.run_attempts == 0 else None
    return Stopped(record, held if isinstance(held, dict) else None)


def delete_response(store: Store, key_id: int, response_id: str, now: int) -> Stopped | None:
    """Mark the response deleted (a running one asked to cancel too: its
    status is then ``cancelled``), or None when there is none for this key."""
    if not ids.is_response_id(response_id):
        return None
    with store.session() as session:
        stopped = _stop(session, key_id, response_id, now, background=False)
        record = session.get(ResponseRecord, response_id, populate_existing=True)
        if record is None or record.key_id != key_id or record.deleted_at is not None:
            return None
        record.deleted_at = now
        session.add(record)
        session.commit()
        session.refresh(record)
        session.expunge(record)
        return _stopped(record, stopped)


def cancel_response(store: Store, key_id: int, response_id: str, now: int) -> Stopped | None:
    """Ask a running background response to stop: ``cancelled`` at once (the
    run sees ``cancel_requested_at`` at its next flush and writes no more;
    one not begun yet never generates). A finished one is left as it is.
    None when there is none for this key."""
    if not ids.is_response_id(response_id):
        return None
    with store.session() as session:
        stopped = _stop(session, key_id, response_id, now, background=True)
        record = session.get(ResponseRecord, response_id, populate_existing=True)
        if record is None or record.key_id != key_id or record.deleted_at is not None:
            return None
        session.commit()
        session.refresh(record)
        session.expunge(record)
        return _stopped(record, stopped)


def _final(record: ResponseRecord, response: dict[str, Any]) -> None:
    record.status = response["status"]
    record.output = response.get("output") or []
    record.usage = response.get("usage")
    record.error = response.get("error")
    record.incomplete_details = response.get("incomplete_details")
    record.completed_at = response.get("completed_at")


def events_after(store: Store, response_id: str, after: int) -> list[dict[str, Any]]:
    """The stored events with a sequence number above ``after``, in order."""
    with store.session() as session:
        chunks = session.exec(
            select(ResponseEventChunk)
            .where(
                ResponseEventChunk.response_id == response_id,
                ResponseEventChunk.last_seq > after,
            )
            .order_by(col(ResponseEventChunk.first_seq))
        ).all()
    return [e for c in chunks for e in c.events if e["sequence_number"] > after]


def is_terminal_event(event: dict[str, Any]) -> bool:
    """Whether ``event`` ends a response's stream."""
    return event.get("type") in _TERMINAL_EVENTS


class RunLost(LlmgwError):
    """Another run of the same response wrote the events this one meant to
    write (two runs at once: this one stops)."""


def append_events(store: Store, response_id: str, events: Sequence[dict[str, Any]]) -> bool:
    """Persist one flush of a background run's events, and mark the row
    ``in_progress`` (while it is running). Whether the response was asked to
    cancel meanwhile. RunLost when those sequence numbers are already stored."""
    first, last = events[0]["sequence_number"], events[-1]["sequence_number"]
    with store.session() as session:
        try:
            session.add(
                ResponseEventChunk(
                    response_id=response_id, first_seq=first, last_seq=last, events=list(events)
                )
            )
            session.flush()
        except IntegrityError:
            session.rollback()
            raise RunLost(response_id) from None
        record = session.get(ResponseRecord, response_id)
        assert record is not None
        if record.last_seq >= first:
            session.rollback()
            raise RunLost(response_id)
        record.last_seq = last
        if record.status == "queued":
            record.status = "in_progress"
        cancelled = record.cancel_requested_at is not None
        session.add(record)
        session.commit()
        return cancelled


def finish_run(store: Store, response_id: str, response: dict[str, Any]) -> bool:
    """A background run's end: the final state (unless it was cancelled
    meanwhile) and its usage billed, once: ``billed_at`` is set in the same
    transaction as the usage row's increment, so a retried run bills nothing
    more. Whether this call billed it.

    The Response's usage is billed: the output tokens of an attempt killed
    before it, which the last attempt read as its prompt, as output."""
    now = int(time.time())
    with store.session() as session:
        record = session.get(ResponseRecord, response_id)
        if record is None:
            return False
        if record.status in RUNNING:
            _final(record, response)
            session.add(record)
        billed = False
        if record.billed_at is None:
            record.billed_at = now
            session.add(record)
            usage = response.get("usage") or {}
            add_usage(
                session,
                record.key_id,
                record.model,
                day_of(now),
                errors=int(record.status not in ("completed", "incomplete")),
                prompt_tokens=int(usage.get("input_tokens") or 0),
                completion_tokens=int(usage.get("output_tokens") or 0),
            )
            billed = True
        session.commit()
        return billed
