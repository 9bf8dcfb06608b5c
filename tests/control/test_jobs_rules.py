"""The batch executor's pure decisions: workflows/jobs_rules.py (ranges,
continue-as-new, endings) and activities/control/jobs_lines.py (a line's
answer, the JSONL shapes, status moves, deterministic ids)."""

import pytest

from activities.control import jobs_lines as lines
from llmgw.types import BatchStatus
from workflows import jobs_rules as rules


def test_ranges_cover_the_lines_once_in_chunks() -> None:
    assert rules.next_ranges(1, 250, 100, 4) == [(1, 100), (101, 200), (201, 250)]
    assert rules.next_ranges(101, 250, 100, 1) == [(101, 200)]
    assert rules.next_ranges(251, 250, 100, 4) == []
    assert rules.next_ranges(1, 10, 100, 0) == []


def test_a_run_stops_scheduling_at_its_chunk_budget_or_when_temporal_suggests() -> None:
    assert rules.may_schedule(0, 0, 200, False)
    assert not rules.may_schedule(198, 2, 200, False)
    assert not rules.may_schedule(0, 0, 200, True)


@pytest.mark.parametrize(
    ("next_line", "total", "cancelled", "expired", "end"),
    [
        (11, 10, False, False, rules.Ending.DONE),
        (5, 10, False, False, rules.Ending.CONTINUE),
        (5, 10, True, True, rules.Ending.CANCELLED),
        (11, 10, False, True, rules.Ending.EXPIRED),
    ],
)
def test_endings(
    next_line: int, total: int, cancelled: bool, expired: bool, end: rules.Ending
) -> None:
    assert rules.ending(next_line, total, cancelled, expired) is end


def test_each_ending_has_its_statuses_and_never_ran_code() -> None:
    assert rules.FINISH[rules.Ending.DONE] == (
        BatchStatus.FINALIZING, "", BatchStatus.COMPLETED,
    )  # fmt: skip
    assert rules.FINISH[rules.Ending.EXPIRED][1:] == ("batch_expired", BatchStatus.EXPIRED)
    assert rules.FINISH[rules.Ending.CANCELLED][1:] == ("batch_cancelled", BatchStatus.CANCELLED)
    assert rules.seconds_left(100.0, 160.0) == 0.0


@pytest.mark.parametrize(
    ("status", "body", "tries", "verdict"),
    [
        (200, {}, 1, lines.Verdict.OK),
        (400, {"error": {"code": "invalid_value"}}, 1, lines.Verdict.FAILED),
        (403, {"error": {"code": "model_not_allowed"}}, 1, lines.Verdict.FAILED),
        (429, {"error": {"code": "rate_limit_exceeded"}}, 9, lines.Verdict.RETRY),
        (503, {"error": {"code": "queue_full"}}, 50, lines.Verdict.RETRY),
        (500, {"error": {"code": "engine_error"}}, 1, lines.Verdict.RETRY),
        (502, {"error": {"code": "bad_gateway"}}, lines.ENGINE_5XX_TRIES, lines.Verdict.FAILED),
        (504, {"error": {"code": "store_unavailable"}}, 99, lines.Verdict.RETRY),
    ],
)
def test_a_lines_answer(status: int, body: object, tries: int, verdict: lines.Verdict) -> None:
    assert lines.verdict(status, body, tries) is verdict


def test_backoff_follows_retry_after_within_bounds() -> None:
    assert lines.backoff_s(1, "3") == 3.0
    assert lines.backoff_s(1, "9999") == lines.BACKOFF_MAX_S
    assert lines.backoff_s(1, None) == lines.BACKOFF_FIRST_S
    assert lines.backoff_s(3, "soon") == 4 * lines.BACKOFF_FIRST_S
    assert lines.backoff_s(40, None) == lines.BACKOFF_MAX_S


def test_usage_of_each_endpoints_answer() -> None:
    assert lines.usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert lines.usage_of({"usage": {"prompt_tokens": 3, "total_tokens": 3}}) == (3, 0)
    assert lines.usage_of({"usage": {"input_tokens": 5, "output_tokens": 6}}) == (5, 6)
    assert lines.usage_of({"usage": {"prompt_tokens": -1, "completion_tokens": "x"}}) == (0, 0)
    assert lines.usage_of(None) == (0, 0)


def test_ids_are_the_same_on_every_try() -> None:
    out = lines.result_file_id("batch_a", "out")
    assert out == lines.result_file_id("batch_a", "out")
    assert out.startswith("file-") and len(out) == 5 + 24
    assert out != lines.result_file_id("batch_a", "err")
    assert out != lines.result_file_id("batch_b", "out")
    assert lines.line_request_id("b", "r1") == lines.line_request_id("b", "r1")
    assert lines.line_request_id("b", "r1").startswith("batch_req_")


def test_the_jsonl_shapes() -> None:
    ran = lines.output_line("b", "r1", 200, "req_1", {"id": "x"})
    assert ran["custom_id"] == "r1" and ran["error"] is None
    assert ran["response"] == {"status_code": 200, "request_id": "req_1", "body": {"id": "x"}}
    never = lines.never_ran_line("b", "r2", "batch_expired")
    assert never["response"] is None and never["error"]["code"] == "batch_expired"
    assert "completion window" in never["error"]["message"]


@pytest.mark.parametrize(
    ("current", "wanted", "result"),
    [
        (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.IN_PROGRESS),
        (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.COMPLETED),
        (BatchStatus.CANCELLED, BatchStatus.EXPIRED, BatchStatus.CANCELLED),
        (BatchStatus.CANCELLING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING),
        (BatchStatus.CANCELLING, BatchStatus.FINALIZING, BatchStatus.CANCELLING),
        (BatchStatus.CANCELLING, BatchStatus.CANCELLED, BatchStatus.CANCELLED),
        (BatchStatus.IN_PROGRESS, BatchStatus.EXPIRED, BatchStatus.EXPIRED),
    ],
)
def test_status_moves(current: BatchStatus, wanted: BatchStatus, result: BatchStatus) -> None:
    assert lines.next_status(current, wanted) is result
