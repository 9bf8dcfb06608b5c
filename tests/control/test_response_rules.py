"""The background response workflow's bounds and end (workflows/response_rules.py),
without Temporal: its one activity is retried a bounded number of times
within an execution timeout, both above the router's own bounds on a run
(router/responses/bounds.py), and a run given up on ends failed."""

from datetime import timedelta

from router.responses.bounds import MAX_RUN_ATTEMPTS, RUN_DEADLINE_S
from workflows import response_rules as rules


def test_the_run_is_retried_a_bounded_number_of_times_within_a_timeout() -> None:
    assert rules.RUN_RETRY.maximum_attempts == rules.MAX_ATTEMPTS > 0
    assert rules.RUN_RETRY.maximum_interval is not None
    # The router fails a response first; the workflow's bounds are a backstop.
    assert rules.MAX_ATTEMPTS > MAX_RUN_ATTEMPTS
    assert timedelta(seconds=RUN_DEADLINE_S) + rules.ATTEMPT_TIMEOUT <= rules.EXECUTION_TIMEOUT


def test_how_a_run_ends() -> None:
    assert rules.final_status(ran=True, failed=False, status="completed") == "completed"
    assert rules.final_status(ran=True, failed=False, status="failed") == "failed"
    assert rules.final_status(ran=True, failed=False, status=None) == "unknown"
    # Given up on (past its attempts or its execution timeout).
    assert rules.final_status(ran=False, failed=True, status=None) == "failed"
    # Cancelled by its signal.
    assert rules.final_status(ran=False, failed=False, status=None) == "cancelled"
