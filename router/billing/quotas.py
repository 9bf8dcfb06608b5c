"""Per-key quotas shared by every router process through the store.

A request *reserves* before it is forwarded: one request and its token
estimate (the prompt estimate plus every token the engine may generate:
``router.api.reservation.reserved_tokens``) are added to the key's counters by a
single conditional ``UPDATE ... WHERE <every limit still holds>``. The
database serialises concurrent UPDATEs of one row (SQLite locks the file,
PostgreSQL the row and re-checks the WHERE on the newest version), so a
check-then-increment race cannot admit more than the limits allow, across any
number of routers; a request reserving more than a whole limit is refused
outright. After the answer the reservation is *settled*: the
difference between real and reserved tokens is applied to the windows it was
taken in (batched; see ``router.billing.accounting``).

Requests and tokens per minute count over a sliding minute, estimated the
usual way from two fixed ones: the current epoch minute's count plus the
previous minute's, weighted by how much of it the last 60 s still cover.
A fixed window would let a key spend its whole limit at 00:59 and again at
01:00; this one admits at most about one limit's worth in any 60 s. The
token budget's window is the fixed UTC day or month. A reservation in a
newer window than the row's moves the counters along in the same statement.
"""

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from sqlalchemy import (
    Float,
    Integer,
    Table,
    Update,
    and_,
    bindparam,
    case,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from llmgw.store import Store
from llmgw.store.gateway_tables import QuotaWindow

Period = Literal["day", "month"]
_T: Table = QuotaWindow.__table__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Limits:
    """A key's limits; 0 = unlimited."""

    rpm: int = 0
    tpm: int = 0
    token_budget: int = 0
    budget_period: Period = "day"


@dataclass(frozen=True)
class QuotaReservation:
    """What a request took; settled once its real usage is known."""

    key_id: int
    tokens: int
    minute: int
    period: int


@dataclass(frozen=True)
class QuotaRejection:
    """Why a reservation was refused and when to retry."""

    limit: Literal["rpm", "tpm", "token_budget"]
    retry_after_s: int
    message: str
    # The request alone is more than the limit: no window will ever admit it.
    never: bool = False


def too_large(limits: Limits, tokens: int) -> QuotaRejection | None:
    """A request reserving more than a whole token limit, refused without asking the store."""
    if limits.tpm and tokens > limits.tpm:
        limit: Literal["tpm", "token_budget"] = "tpm"
        what = f"the key's {limits.tpm} tokens per minute"
    elif limits.token_budget and tokens > limits.token_budget:
        limit = "token_budget"
        what = f"the key's budget of {limits.token_budget} tokens per {limits.budget_period}"
    else:
        return None
    return QuotaRejection(
        limit,
        0,
        f"This request reserves {tokens} tokens (prompt estimate + max_tokens or n_predict"
        f" x n/best_of), more than {what}: lower them.",
        never=True,
    )


def minute_of(now: float) -> int:
    """The epoch minute of ``now`` (seconds since the epoch)."""
    return int(now // 60)


def period_of(now: float, period: Period) -> int:
    """The index of the budget period holding ``now``: epoch days, or months since year 0."""
    if period == "day":
        return int(now // 86400)
    when = datetime.fromtimestamp(now, UTC)
    return when.year * 12 + when.month - 1


def period_end(index: int, period: Period) -> float:
    """When budget period ``index`` ends (seconds since the epoch)."""
    if period == "day":
        return float((index + 1) * 86400)
    year, month0 = divmod(index + 1, 12)
    return datetime(year, month0 + 1, 1, tzinfo=UTC).timestamp()


def previous_weight(now: float) -> float:
    """How much of the previous minute the 60 s up to ``now`` still cover."""
    return 1.0 - (now % 60) / 60


def sliding_count(prev: int, current: int, now: float) -> float:
    """The estimated count over the 60 s up to ``now``."""
    return prev * previous_weight(now) + current


def sliding_retry_after(prev: int, current: int, need: int, limit: int, now: float) -> int:
    """Seconds until ``need`` more fits under ``limit`` if nothing else is taken."""
    minute = minute_of(now)
    room = limit - need - current
    if room >= 0 and prev > 0:
        # This minute: the previous one's weight falls until prev * w <= room.
        at = minute * 60 + 60 * (1 - room / prev)
    elif room >= 0:
        at = now
    elif limit - need >= 0 and current > 0:
        # Next minute: this one's count becomes the previous one and decays.
        at = (minute + 1) * 60 + 60 * (1 - (limit - need) / current)
    else:
        at = (minute + 1) * 60 if limit >= need else (minute + 2) * 60
    return max(1, math.ceil(at - now))


# A row never moves back to an older window: a request stamped just before a
# boundary whose UPDATE lands after one stamped just after it (threads,
# routers' clocks) counts in the row's newer window instead of resetting it.


def _current(counter: str, window: str) -> ColumnElement[int]:
    """The counter's value in the request's window: zero when the row is of an older one."""
    return case((_T.c[window] >= bindparam(window), _T.c[counter]), else_=0)


def _previous(counter: str) -> ColumnElement[int]:
    """The counter's value in the minute before the request's."""
    minute = bindparam("minute", type_=Integer)
    return case(
        (_T.c.minute >= minute, _T.c[f"prev_{counter}"]),
        (_T.c.minute == minute - 1, _T.c[counter]),
        else_=0,
    )


def _newest(window: str) -> ColumnElement[int]:
    """The window the row moves to: the request's, unless the row's is newer."""
    ours = bindparam(window, type_=Integer)
    return case((_T.c[window] > ours, _T.c[window]), else_=ours)


def _reserve_statement() -> Update:
    # Built once: the same statement for every key and limit (bound parameters,
    # a limit of 0 disables its condition), so SQLAlchemy compiles it once.
    reqs = _current("minute_requests", "minute")
    mtok = _current("minute_tokens", "minute")
    prev_reqs = _previous("minute_requests")
    prev_mtok = _previous("minute_tokens")
    ptok = _current("period_tokens", "period")
    weight = bindparam("weight", type_=Float)
    tokens = bindparam("tokens", type_=Integer)
    rpm = bindparam("rpm", type_=Integer)
    tpm = bindparam("tpm", type_=Integer)
    budget = bindparam("budget", type_=Integer)
    return (
        update(_T)
        .where(
            _T.c.key_id == bindparam("key"),
            or_(rpm == 0, prev_reqs * weight + reqs + 1 <= rpm),
            or_(tpm == 0, prev_mtok * weight + mtok + tokens <= tpm),
            or_(budget == 0, ptok + tokens <= budget),
        )
        .values(
            minute=_newest("minute"),
            minute_requests=reqs + 1,
            minute_tokens=mtok + tokens,
            prev_minute_requests=prev_reqs,
            prev_minute_tokens=prev_mtok,
            period=_newest("period"),
            period_tokens=ptok + tokens,
        )
    )


_RESERVE = _reserve_statement()


class Quotas:
    """Reserve and settle against the store's quota windows (synchronous; call in a thread)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def reserve(
        self, key_id: int, limits: Limits, tokens: int, now: float
    ) -> QuotaReservation | QuotaRejection:
        """Take one request and ``tokens`` from the key's quotas, or say why not."""
        if (refused := too_large(limits, tokens)) is not None:
            return refused
        minute, period = minute_of(now), period_of(now, limits.budget_period)
        params = {
            "key": key_id,
            "minute": minute,
            "period": period,
            "weight": previous_weight(now),
            "tokens": tokens,
            "rpm": limits.rpm,
            "tpm": limits.tpm,
            "budget": limits.token_budget,
        }
        for attempt in range(2):
            with self._store.session() as session:
                conn = session.connection()
                if conn.dialect.name == "postgresql":
                    # A reservation lost to a database crash only frees quota:
                    # not worth waiting for the WAL flush on every request.
                    conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
                result = conn.execute(_RESERVE, params)
                session.commit()
            if result.rowcount == 1:
                return QuotaReservation(key_id, tokens, minute, period)
            if attempt == 0:
                # No row yet, or one another router made after our UPDATE:
                # either way the second UPDATE decides.
                self.ensure_row(key_id)
        return self._why(key_id, limits, tokens, now)

    def ensure_row(self, key_id: int) -> None:
        """Create the key's counters if missing (racing routers: one wins)."""
        with self._store.session() as session:
            conn = session.connection()
            if conn.execute(select(_T.c.key_id).where(_T.c.key_id == key_id)).first():
                return
            try:
                conn.execute(insert(_T).values(key_id=key_id))
                session.commit()
            except IntegrityError:
                session.rollback()  # another router made it: fine

    def _why(self, key_id: int, limits: Limits, tokens: int, now: float) -> QuotaRejection:
        minute, period = minute_of(now), period_of(now, limits.budget_period)
        with self._store.session() as session:
            row = session.connection().execute(select(_T).where(_T.c.key_id == key_id)).first()
        reqs = mtok = prev_reqs = prev_mtok = used_ptok = 0
        if row is not None and row.minute == minute:
            reqs, mtok = row.minute_requests, row.minute_tokens
            prev_reqs, prev_mtok = row.prev_minute_requests, row.prev_minute_tokens
        elif row is not None and row.minute == minute - 1:
            prev_reqs, prev_mtok = row.minute_requests, row.minute_tokens
        if row is not None and row.period == period:
            used_ptok = row.period_tokens
        if limits.rpm and sliding_count(prev_reqs, reqs, now) + 1 > limits.rpm:
            return QuotaRejection(
                "rpm",
                sliding_retry_after(prev_reqs, reqs, 1, limits.rpm, now),
                f"Rate limit reached: {limits.rpm} requests per minute.",
            )
        if limits.tpm and sliding_count(prev_mtok, mtok, now) + tokens > limits.tpm:
            used = round(sliding_count(prev_mtok, mtok, now))
            return QuotaRejection(
                "tpm",
                sliding_retry_after(prev_mtok, mtok, tokens, limits.tpm, now),
                f"Rate limit reached: {limits.tpm} tokens per minute "
                f"(used {used} in the last 60 s, this request reserves {tokens}).",
            )
        to_period_end = max(1, int(period_end(period, limits.budget_period) - now + 0.999))
        if not (limits.token_budget and used_ptok + tokens > limits.token_budget):
            # Nothing over its limit any more (settled meanwhile): retry soon.
            return QuotaRejection("rpm" if limits.rpm else "tpm", 1, "Rate limit reached; retry.")
        return QuotaRejection(
            "token_budget",
            to_period_end,
            f"Token budget exhausted: {limits.token_budget} tokens per {limits.budget_period} "
            f"(used {used_ptok}, this request reserves {tokens}).",
        )

    def settle(self, adjustments: dict[tuple[int, str, int], int]) -> None:
        """Apply token corrections: ``(key_id, "minute"|"period", window) -> delta``.

        A minute's correction lands on it as the row's current or previous
        minute; one for a window older than that is dropped (its counters
        were reset). Counters never go below zero.
        """
        with self._store.session() as session:
            conn = session.connection()
            for (key_id, window, index), delta in adjustments.items():
                if delta == 0:
                    continue
                targets = [(window, index, "period_tokens")]
                if window == "minute":
                    # The minute may have become the row's previous one.
                    targets = [
                        ("minute", index, "minute_tokens"),
                        ("minute", index + 1, "prev_minute_tokens"),
                    ]
                for where, at, column in targets:
                    value = _T.c[column] + delta
                    conn.execute(
                        update(_T)
                        .where(and_(_T.c.key_id == key_id, _T.c[where] == at))
                        .values({column: case((value < 0, 0), else_=value)})
                    )
            session.commit()
