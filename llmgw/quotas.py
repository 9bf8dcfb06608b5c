"""Per-key quotas shared by every router process through the store.

A request *reserves* before it is forwarded: one request and its token
estimate (prompt estimate + max_tokens) are added to the key's counters by a
single conditional ``UPDATE ... WHERE <every limit still holds>``. The
database serialises concurrent UPDATEs of one row (SQLite locks the file,
PostgreSQL the row and re-checks the WHERE on the newest version), so a
check-then-increment race cannot admit more than the limits allow, across any
number of routers. After the answer the reservation is *settled*: the
difference between real and reserved tokens is applied to the windows it was
taken in (batched; see ``router.accounting``).

Windows are fixed: the epoch minute for requests and tokens per minute, the
UTC day or month for the token budget. A reservation in a newer window than
the row's starts that window's counters from zero in the same statement.
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from sqlalchemy import Integer, Table, Update, and_, bindparam, case, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from llmgw.gateway_tables import QuotaWindow
from llmgw.store import Store

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
class Reservation:
    """What a request took; settled once its real usage is known."""

    key_id: int
    tokens: int
    minute: int
    period: int


@dataclass(frozen=True)
class Rejection:
    """Why a reservation was refused and when to retry."""

    limit: Literal["rpm", "tpm", "token_budget"]
    retry_after_s: int
    message: str


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


def _current(counter: str, window: str) -> ColumnElement[int]:
    """The counter's value in the request's window: zero when the row is of an older one."""
    return case((_T.c[window] == bindparam(window), _T.c[counter]), else_=0)


def _reserve_statement() -> Update:
    # Built once: the same statement for every key and limit (bound parameters,
    # a limit of 0 disables its condition), so SQLAlchemy compiles it once.
    reqs = _current("minute_requests", "minute")
    mtok = _current("minute_tokens", "minute")
    ptok = _current("period_tokens", "period")
    tokens = bindparam("tokens", type_=Integer)
    rpm = bindparam("rpm", type_=Integer)
    tpm = bindparam("tpm", type_=Integer)
    budget = bindparam("budget", type_=Integer)
    return (
        update(_T)
        .where(
            _T.c.key_id == bindparam("key"),
            or_(rpm == 0, reqs + 1 <= rpm),
            or_(tpm == 0, mtok + tokens <= tpm),
            or_(budget == 0, ptok + tokens <= budget),
        )
        .values(
            minute=bindparam("minute"),
            minute_requests=reqs + 1,
            minute_tokens=mtok + tokens,
            period=bindparam("period"),
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
    ) -> Reservation | Rejection:
        """Take one request and ``tokens`` from the key's quotas, or say why not."""
        minute, period = minute_of(now), period_of(now, limits.budget_period)
        params = {
            "key": key_id,
            "minute": minute,
            "period": period,
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
                return Reservation(key_id, tokens, minute, period)
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

    def _why(self, key_id: int, limits: Limits, tokens: int, now: float) -> Rejection:
        minute, period = minute_of(now), period_of(now, limits.budget_period)
        with self._store.session() as session:
            row = session.connection().execute(select(_T).where(_T.c.key_id == key_id)).first()
        to_next_minute = max(1, int((minute + 1) * 60 - now + 0.999))
        used_reqs = row.minute_requests if row is not None and row.minute == minute else 0
        used_mtok = row.minute_tokens if row is not None and row.minute == minute else 0
        used_ptok = row.period_tokens if row is not None and row.period == period else 0
        if limits.rpm and used_reqs + 1 > limits.rpm:
            return Rejection(
                "rpm", to_next_minute, f"Rate limit reached: {limits.rpm} requests per minute."
            )
        if limits.tpm and used_mtok + tokens > limits.tpm:
            return Rejection(
                "tpm",
                to_next_minute,
                f"Rate limit reached: {limits.tpm} tokens per minute "
                f"(used {used_mtok}, this request reserves {tokens}).",
            )
        to_period_end = max(1, int(period_end(period, limits.budget_period) - now + 0.999))
        if not (limits.token_budget and used_ptok + tokens > limits.token_budget):
            # Nothing over its limit any more (settled meanwhile): retry soon.
            return Rejection("rpm" if limits.rpm else "tpm", 1, "Rate limit reached; retry.")
        return Rejection(
            "token_budget",
            to_period_end,
            f"Token budget exhausted: {limits.token_budget} tokens per {limits.budget_period} "
            f"(used {used_ptok}, this request reserves {tokens}).",
        )

    def settle(self, adjustments: dict[tuple[int, str, int], int]) -> None:
        """Apply token corrections: ``(key_id, "minute"|"period", window) -> delta``.

        A correction for a window that has since rolled over is dropped (its
        counters were reset). Counters never go below zero.
        """
        with self._store.session() as session:
            conn = session.connection()
            for (key_id, window, index), delta in adjustments.items():
                if delta == 0:
                    continue
                column = "minute_tokens" if window == "minute" else "period_tokens"
                value = _T.c[column] + delta
                conn.execute(
                    update(_T)
                    .where(and_(_T.c.key_id == key_id, _T.c[window] == index))
                    .values({column: case((value < 0, 0), else_=value)})
                )
            session.commit()
