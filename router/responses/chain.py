"""The conversation a request continuing ``previous_response_id`` carries:
every response of the chain's input and output items, oldest first.

Loaded within bounds, in a thread the request waits for (router/api/responses.py):

- at most ``MAX_CHAIN`` links, and at most ``max_bytes`` of items: past it the
  loading stops (ChainTooLarge) and the router holds no more of it;
- by a deadline, the request's store wait: each step checks it, and on
  PostgreSQL every statement is given what is left of it
  (``statement_timeout``, ``lock_timeout``), so a stalled store (a lock, a
  frozen server) ends the thread with the request's 503 instead of leaving
  it blocked behind the answer;
- only the named response's row is read whole (for its root); the others'
  ``request`` (which holds the whole conversation up to them) is never read.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from llmgw.errors import LlmgwError, StoreError
from llmgw.store import Store
from llmgw.store.openai_tables import ResponseInputItem, ResponseRecord
from router.responses import ids
from router.responses.bounds import size_of
from router.responses.request import Item, parse_items

# The longest previous_response_id chain followed.
MAX_CHAIN = 256


class PreviousNotFound(LlmgwError):
    """``previous_response_id`` names no stored response of this key (or a
    link of its chain is missing, deleted or another key's)."""


class PreviousFailed(LlmgwError):
    """``previous_response_id`` names a failed response: its output is not an
    answer to continue (OpenAI refuses it too)."""


class ChainTooLarge(LlmgwError):
    """The chain's items are more than the bound: loading stopped there."""


@dataclass(frozen=True)
class Chain:
    """The conversation before the new request, and its root: the id of its
    first response (every turn of a conversation routes by it)."""

    history: list[Item]
    root: str
    bytes: int


@contextmanager
def bounded_session(store: Store, deadline: float) -> Iterator[Session]:
    """A session whose statements end by ``deadline`` (time.monotonic()):
    on PostgreSQL each waits at most what is left (SQLite readers do not
    wait on writers, and its busy timeout bounds a write)."""
    with store.session() as session:
        conn = session.connection()
        if conn.dialect.name == "postgresql":
            ms = min(max(1, int((deadline - time.monotonic()) * 1000)), 2**31 - 1)
            conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = {ms}")
        yield session


def _in_time(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise StoreError("the request no longer waits for this chain")


def load_chain(
    store: Store, key_id: int, previous_id: str, *, max_bytes: int, deadline: float
) -> Chain:
    """The chain ending at ``previous_id``, of this key. PreviousNotFound,
    PreviousFailed, ChainTooLarge; StoreError past ``deadline``.

    A response records its root (``request["root"]``): the named one's is
    taken as it is, so a chain longer than MAX_CHAIN keeps one root."""
    if not ids.is_response_id(previous_id):
        raise PreviousNotFound(previous_id)  # no response's id (PostgreSQL refuses a NUL)
    turns: list[list[dict[str, Any]]] = []
    total = 0
    with bounded_session(store, deadline) as session:
        _in_time(deadline)
        tip = session.get(ResponseRecord, previous_id)
        if tip is None or tip.key_id != key_id or tip.deleted_at is not None:
            raise PreviousNotFound(previous_id)
        if tip.status == "failed":
            raise PreviousFailed(previous_id)
        recorded = tip.request.get("root")
        link: tuple[str, list[dict[str, Any]], str | None] | None = (
            tip.id, list(tip.output), tip.previous_response_id,
        )  # fmt: skip
        root = previous_id
        for _ in range(MAX_CHAIN):
            if link is None:
                break
            current, output, before = link
            root = current
            _in_time(deadline)
            rows = session.exec(
                select(ResponseInputItem.item)
                .where(ResponseInputItem.response_id == current)
                .order_by(col(ResponseInputItem.idx))
            ).all()
            turn: list[dict[str, Any]] = [*map(dict, rows), *output]
            total += sum(size_of(i) for i in turn)
            if total > max_bytes:
                raise ChainTooLarge(current)
            turns.append(turn)
            link = None if before is None else _link(session, key_id, before, deadline)
    items = [i for turn in reversed(turns) for i in turn]
    return Chain(parse_items(items), recorded if isinstance(recorded, str) else root, total)


def _link(
    session: Session, key_id: int, response_id: str, deadline: float
) -> tuple[str, list[dict[str, Any]], str | None]:
    """An earlier link: its output and the one before it (not its request)."""
    _in_time(deadline)
    row = session.execute(
        sa_select(
            col(ResponseRecord.key_id),
            col(ResponseRecord.deleted_at),
            col(ResponseRecord.status),
            col(ResponseRecord.output),
            col(ResponseRecord.previous_response_id),
        ).where(col(ResponseRecord.id) == response_id)
    ).first()
    if row is None or row[0] != key_id or row[1] is not None:
        raise PreviousNotFound(response_id)
    if row[2] == "failed":
        raise PreviousFailed(response_id)
    return response_id, list(row[3]), row[4]
