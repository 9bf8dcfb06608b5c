"""Pure decisions of the background response workflow (workflows/jobs_response.py):
how its one activity is retried and bounded, and what a run that ended
says. No Temporal client here: tests/control/test_response_rules.py.

The router bounds a run first (router/responses/bounds.py: it counts the
attempts that reach it and ends the response failed past MAX_RUN_ATTEMPTS
or RUN_DEADLINE_S after its creation). These are the workflow's own bounds
above those, for attempts that never reach a router (none answers): the
activity is then given up on, and the workflow ends.
"""

from datetime import timedelta

from temporalio.common import RetryPolicy

# Above the router's 8 attempts: a few more that may never have reached one.
MAX_ATTEMPTS = 12
# Each attempt: as long as a generation may take (it heartbeats throughout).
ATTEMPT_TIMEOUT = timedelta(hours=2)
# All attempts together, backoff included: the router's 2 h deadline and
# the last attempt's own run.
EXECUTION_TIMEOUT = timedelta(hours=4)

RUN_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=MAX_ATTEMPTS,
)


def final_status(ran: bool, failed: bool, status: str | None) -> str:
    """The status the workflow reports: the run's own when the activity
    ended (``status``), ``failed`` when it was given up on (past its
    attempts or its execution timeout), ``cancelled`` when it was cancelled
    (``ran`` false)."""
    if failed:
        return "failed"
    if not ran:
        return "cancelled"
    return status or "unknown"
