"""What a client key may do: models, expiry, admin, quotas, its queue share and class.

The policy is what billing and admission act on; the keys themselves (made,
listed, looked up by hash) are the API's (router/api/apikeys.py).
"""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from llmgw.types import Priority

# The limits are INTEGER columns: 32-bit on PostgreSQL.
INT32_MAX = 2**31 - 1
# Weights are relative; a bound keeps virtual finish times well-behaved.
MAX_WEIGHT = 1000.0


def _iso_text(value: Any) -> Any:
    """A date-time given as text (ISO 8601) or a datetime, never a number:
    pydantic would read 0 as 1970-01-01, a schema-violating input taken."""
    if isinstance(value, (int, float)):
        raise ValueError("a date-time is an ISO 8601 string, not a number")
    return value


# A date-time of the admin API's bodies.
IsoDateTime = Annotated[datetime, BeforeValidator(_iso_text)]


class KeyPolicy(BaseModel):
    """What a key may do; every limit 0 means unlimited."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=list, description="allowed models; empty = all")
    expires_at: IsoDateTime | None = Field(default=None, description="UTC; none = never")
    # Strict (the admin API's bodies): "5" is no integer, "true" no boolean.
    admin: bool = Field(
        default=False, strict=True, description="opens the admin API (and only that)"
    )
    rpm: int = Field(default=0, ge=0, le=INT32_MAX, strict=True, description="requests per minute")
    tpm: int = Field(
        default=0,
        ge=0,
        le=INT32_MAX,
        strict=True,
        description="tokens per minute (prompt + completion)",
    )
    token_budget: int = Field(
        default=0, ge=0, le=INT32_MAX, strict=True, description="tokens per budget period"
    )
    budget_period: Literal["day", "month"] = "day"
    weight: float = Field(
        default=1.0,
        gt=0,
        le=MAX_WEIGHT,
        strict=True,
        description="share of a busy model's tokens vs other keys",
    )
    priority: Priority = Field(
        default=Priority.NORMAL, description="admission queue class: high, normal, batch"
    )

    def has_quota(self) -> bool:
        """Whether requests of this key go through the quota store at all."""
        return bool(self.rpm or self.tpm or self.token_budget)

    def allows(self, model: str) -> bool:
        """Whether the key may use ``model``."""
        return not self.models or model in self.models
