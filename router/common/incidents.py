"""The full reasons behind the errors clients got without them (``/admin/errors``).

Split from router/common/errors.py, which builds what the client sees: this is
what the admin sees instead, a record by error id. It needs nothing of the
error table, so the table imports it (``ErrorKind.error(incidents=...)``)
and router/common/errors.py names it too, for its importers.
"""

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

# The log line of an incident keeps the logger it had before the split
# (operators' logging configuration, tests' caplog name it).
log = logging.getLogger("router.common.errors")

# Reasons kept for the admin API; the log keeps every one.
KEEP_INCIDENTS = 1000
# A reason is cut past this (an engine's answer may be long).
MAX_REASON_CHARS = 4000


class Incident(BaseModel):
    """Why a client got a fixed message: the full reason, for admins only
    (``/admin/errors``; a model so the API reference documents its fields)."""

    model_config = ConfigDict(frozen=True)

    error_id: str = Field(description="The id the client was given (its x-request-id).")
    at: float = Field(description="When, in epoch seconds.")
    status: int = Field(description="The HTTP status the client got.")
    code: str = Field(description="The error code the client got.")
    model: str = Field(description="The model the request named.")
    reason: str = Field(description="The full reason (node names, paths, engine output).")


class Incidents:
    """The full reasons behind the errors clients got without them, by error id:
    logged as they happen (one line with the id), the last ``keep`` kept."""

    def __init__(self, keep: int = KEEP_INCIDENTS, clock: Callable[[], float] = time.time):
        self._keep = keep
        self._clock = clock
        self._by_id: OrderedDict[str, Incident] = OrderedDict()

    def record(self, status: int, code: str, model: str, reason: str) -> str:
        """Log and keep ``reason``; the id the client is given."""
        error_id = f"err_{secrets.token_hex(8)}"
        reason = reason[:MAX_REASON_CHARS]
        log.warning("%d %s for `%s` (error id %s): %s", status, code, model, error_id, reason)
        self._by_id[error_id] = Incident(
            error_id=error_id,
            at=self._clock(),
            status=status,
            code=code,
            model=model,
            reason=reason,
        )
        while len(self._by_id) > self._keep:
            self._by_id.popitem(last=False)
        return error_id

    def get(self, error_id: str) -> Incident | None:
        """The incident behind ``error_id``, while it is kept."""
        return self._by_id.get(error_id)

    def recent(self, limit: int = 100) -> list[Incident]:
        """The latest incidents, newest first."""
        return list(reversed(self._by_id.values()))[:limit]
