"""Usage accounting per key, model and UTC day.

Routers add to the counters in batches (``router.billing.accounting``); the rows
are shared by every router, so a batch adds (``UPDATE ... SET n = n + d``)
rather than writes (llmgw/store/usage.py, shared with the control worker,
which bills a batch line with its result). Portable SQL: SQLite and PostgreSQL.
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache

from pydantic import BaseModel, Field
from sqlalchemy import Table, select

from llmgw.store import Store
from llmgw.store.gateway_tables import UsageDaily
from llmgw.store.usage import add_usage

_T: Table = UsageDaily.__table__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class UsageKey:
    """Whose usage, of what, on which day."""

    key_id: int
    model: str
    day: str


@dataclass
class UsageDelta:
    """What to add to a usage row."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: "UsageDelta") -> None:
        """Accumulate ``other`` into this delta."""
        self.requests += other.requests
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens


class UsageRow(BaseModel):
    """A usage row as the admin API returns it."""

    key_id: int
    model: str
    day: str
    # Never negative (a spool file saying otherwise is refused: router/billing/usage_spool.py).
    requests: int = Field(ge=0)
    errors: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


def day_of(now: float) -> str:
    """The UTC day of ``now`` as YYYY-MM-DD."""
    # Once per request on the hot path: strftime was 2-3 % of the router's
    # CPU, so each day's string is made once (POSIX days are 86,400 s).
    return _day(int(now // 86400))


@lru_cache(maxsize=4)
def _day(days: int) -> str:
    return datetime.fromtimestamp(days * 86400, UTC).strftime("%Y-%m-%d")


def record(store: Store, batch: dict[UsageKey, UsageDelta]) -> None:
    """Add a batch of deltas to the usage rows, a transaction per row.

    Each delta leaves ``batch`` once its transaction has committed, so when
    the store fails part-way ``batch`` holds exactly what is still to add:
    the caller keeps that for its next try, and a row already added is never
    added again (a whole batch kept would bill its first rows twice).
    """
    for key, delta in list(batch.items()):
        with store.session() as session:
            add_usage(
                session,
                key.key_id,
                key.model,
                key.day,
                requests=delta.requests,
                errors=delta.errors,
                prompt_tokens=delta.prompt_tokens,
                completion_tokens=delta.completion_tokens,
            )
            session.commit()
            del batch[key]


def query(
    store: Store,
    key_id: int | None = None,
    model: str | None = None,
    since: str | None = None,
    until: str | None = None,
) -> list[UsageRow]:
    """Usage rows matching the filters (days inclusive, YYYY-MM-DD)."""
    stmt = select(_T)
    if key_id is not None:
        stmt = stmt.where(_T.c.key_id == key_id)
    if model is not None:
        stmt = stmt.where(_T.c.model == model)
    if since is not None:
        stmt = stmt.where(_T.c.day >= since)
    if until is not None:
        stmt = stmt.where(_T.c.day <= until)
    stmt = stmt.order_by(_T.c.day, _T.c.key_id, _T.c.model)
    with store.session() as session:
        rows = session.connection().execute(stmt).mappings().all()
    return [UsageRow.model_validate(dict(r)) for r in rows]
