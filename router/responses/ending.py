"""Ending a background response as failed, whoever finds it must end: the
run that cannot continue it or is past its bounds (router/api/response_run.py),
or a reader of one its workflow gave up on (router/api/responses.py).

A response still ``queued`` or ``in_progress`` ABANDONED_AFTER_S after its
creation has no run left: the router fails a run past RUN_DEADLINE_S, and
the workflow gives its activity up within its execution timeout
(workflows/response_rules.py). That happens when no router was reached
(every attempt lost) or the workflow never ran: the first read of it (GET,
a stream) then ends it failed, so no stream follows it forever.
"""

import contextlib
from typing import Any

from llmgw.store import Store
from llmgw.store.openai_tables import ResponseRecord
from router.responses import store as rstore

# Past the workflow's 4 h execution timeout, with an hour to spare.
ABANDONED_AFTER_S = 5 * 3600
ABANDONED = "The response was not generated: its run was given up on."


def fail_run(store: Store, response_id: str, stored: list[dict[str, Any]], message: str) -> None:
    """End a run as failed: a ``response.failed`` event after the ``stored``
    ones (so streams end), the state, the bill."""
    before: dict[str, Any] = next((e["response"] for e in reversed(stored) if "response" in e), {})
    response = {
        **before,
        "status": "failed",
        "error": {"code": "server_error", "message": message},
    }
    failed = {
        "type": "response.failed",
        "sequence_number": max((e["sequence_number"] for e in stored), default=-1) + 1,
        "response": response,
    }
    with contextlib.suppress(rstore.RunLost):
        rstore.append_events(store, response_id, [failed])
    rstore.finish_run(store, response_id, response)


def is_abandoned(record: ResponseRecord, now: float) -> bool:
    """Whether ``record`` is a background response no run will end any more."""
    return (
        record.background
        and record.status in rstore.RUNNING
        and now - record.created_at > ABANDONED_AFTER_S
    )


def fail_abandoned(store: Store, record: ResponseRecord) -> ResponseRecord:
    """End an abandoned response failed; the row as it is then."""
    fail_run(store, record.id, rstore.events_after(store, record.id, -1), ABANDONED)
    after = rstore.get_response(store, record.key_id, record.id)
    return after if after is not None else record
