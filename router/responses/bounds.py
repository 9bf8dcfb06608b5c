"""What ``/v1/responses`` may hold and how long a background run may take.

- **Stored size**: a response is stored with its request as the run needs it
  (``request["chat"]``: the whole previous_response_id conversation, so any
  router can run it after any restart) and its input items. Its size is
  measured before anything is written, the chain counted as it is loaded:
  a chain past ``max_response_bytes`` stops loading there (the router holds
  no more of it) and the request is refused (400 ``response_too_large``).
- **Per key**: a key's live stored responses hold at most
  ``max_key_response_bytes`` (400 ``response_storage_full``); a deleted one
  stops counting.
- **Runs**: a background run is attempted at most ``MAX_RUN_ATTEMPTS`` times
  and never past ``RUN_DEADLINE_S`` after its creation; the router counts
  the attempts (``run_attempts``, one per call of its run endpoint) and ends
  the response ``failed`` past either (router/api/response_run.py). The
  workflow's own retry policy is a backstop above these
  (workflows/response_rules.py).
"""

from dataclasses import dataclass
from typing import Any

import orjson

MiB = 1024 * 1024

# A 429 (queue full, quota) or a lost engine is retried with Temporal's
# backoff (1 s doubling to 30 s): eight attempts span about a minute and a half.
MAX_RUN_ATTEMPTS = 8
RUN_DEADLINE_S = 2 * 3600


@dataclass(frozen=True)
class ResponseBounds:
    """LLMGW_MAX_RESPONSE_BYTES and LLMGW_MAX_KEY_RESPONSE_BYTES."""

    max_response_bytes: int = 16 * MiB
    max_key_response_bytes: int = 1024 * MiB


def size_of(value: Any) -> int:
    """The bytes ``value`` takes as the store's JSON column holds it (near enough)."""
    return len(orjson.dumps(value))


def run_refusal(attempt: int, created_at: int, now: float) -> str | None:
    """Why attempt ``attempt`` (1-based) of a run created at ``created_at``
    must not generate (None: it may): the response then ends failed."""
    if attempt > MAX_RUN_ATTEMPTS:
        return f"gave up after {MAX_RUN_ATTEMPTS} attempts"
    if now - created_at > RUN_DEADLINE_S:
        return f"not finished within {RUN_DEADLINE_S} s of its creation"
    return None
