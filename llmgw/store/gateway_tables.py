"""The gateway's own tables: quota windows and usage counters.

Kept apart from ``llmgw.store`` (which imports this module, so every table is
in ``SQLModel.metadata`` wherever the store is used, ``store migrate``
included). Plain SQLModel types only: the same tables on SQLite and
PostgreSQL.
"""

from sqlalchemy import BigInteger
from sqlmodel import Field, SQLModel


class QuotaWindow(SQLModel, table=True):
    """A key's quota counters for the current minute and budget period.

    ``minute`` is the epoch minute and ``period`` the budget period's index
    the counters belong to; ``prev_*`` are the minute before ``minute``'s
    (the sliding minute weighs them in); a reservation in a newer window
    moves the counters along (see ``router.billing.quotas``).
    """

    key_id: int = Field(primary_key=True)
    minute: int = 0
    minute_requests: int = 0
    minute_tokens: int = Field(default=0, sa_type=BigInteger)
    prev_minute_requests: int = 0
    prev_minute_tokens: int = Field(default=0, sa_type=BigInteger)
    period: int = 0
    period_tokens: int = Field(default=0, sa_type=BigInteger)


class UsageDaily(SQLModel, table=True):
    """What a key used of a model on one UTC day."""

    key_id: int = Field(primary_key=True)
    model: str = Field(primary_key=True)
    day: str = Field(primary_key=True, description="YYYY-MM-DD, UTC")
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = Field(default=0, sa_type=BigInteger)
    completion_tokens: int = Field(default=0, sa_type=BigInteger)
