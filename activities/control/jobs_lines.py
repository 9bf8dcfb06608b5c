"""Pure decisions of the batch executor's activities: how a line's answer is
treated, the JSONL shapes of the output and error files (OpenAI's
``BatchRequestOutput``), the status moves a batch may make, and the ids that
must come out the same on every retry. No I/O here: tests/control/test_jobs_rules.py."""

import enum
import hashlib
from typing import Any

from llmgw.types import TERMINAL_BATCH, BatchStatus

# Past this many tries an engine's 5xx (not the router's own queue or
# replica answers) is the line's failure.
ENGINE_5XX_TRIES = 3
# Backoff between tries of a line the router could not take yet.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0

# The router's answers that mean "not now" (its queue, no replica yet, a
# store outage): retried, never a line's failure.
_RETRY_CODES = frozenset(
    {
        "queue_full",
        "queue_timeout",
        "replicas_saturated",
        "no_ready_replica",
        "store_unavailable",
        "wake_failed",
    }
)

NEVER_RAN_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed: the batch was cancelled.",
}


class Verdict(enum.Enum):
    OK = "ok"  # 2xx: the output file
    FAILED = "failed"  # the request's own error: the error file
    RETRY = "retry"  # not now: try again later


def verdict(status: int, body: Any, tries: int) -> Verdict:
    """What to do with a line's answer ``status``/``body`` after ``tries`` tries."""
    if 200 <= status < 300:
        return Verdict.OK
    if status in {408, 429, 499, 503}:
        return Verdict.RETRY
    code = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = str(body["error"].get("code") or "")
    if code in _RETRY_CODES:
        return Verdict.RETRY
    if status >= 500:
        return Verdict.RETRY if tries < ENGINE_5XX_TRIES else Verdict.FAILED
    return Verdict.FAILED


def backoff_s(tries: int, retry_after: str | None) -> float:
    """How long to wait before the next try: the router's Retry-After when it
    gave one, else doubling from BACKOFF_FIRST_S, at most BACKOFF_MAX_S."""
    if retry_after is not None:
        try:
            given = float(retry_after)
            return min(BACKOFF_MAX_S, max(0.0, given))
        except ValueError:
            pass
    wait: float = BACKOFF_FIRST_S * 2.0 ** max(0, tries - 1)
    return min(BACKOFF_MAX_S, wait)


def usage_of(body: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer: chat, completions and
    embeddings' ``usage``, or the Responses API's input/output tokens."""
    if not isinstance(body, dict) or not isinstance(body.get("usage"), dict):
        return 0, 0
    usage = body["usage"]
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return _int(prompt), _int(completion)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _b62(digest: bytes, n: int) -> str:
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    number = int.from_bytes(digest, "big")
    out = []
    for _ in range(n):
        number, rest = divmod(number, 62)
        out.append(alphabet[rest])
    return "".join(out)


def result_file_id(batch_id: str, which: str) -> str:
    """The output (``out``) or error (``err``) file's id: the same on every
    try of finalize, so a retried finalize replaces it rather than adding one."""
    return "file-" + _b62(hashlib.sha256(f"{batch_id}/{which}".encode()).digest(), 24)


def line_request_id(batch_id: str, custom_id: str) -> str:
    """A line's ``batch_req_`` id: the same whichever try wrote it."""
    digest = hashlib.sha256(f"{batch_id}/{custom_id}".encode()).hexdigest()
    return f"batch_req_{digest[:32]}"


def output_line(
    batch_id: str, custom_id: str, status_code: int, request_id: str, body: Any
) -> dict[str, Any]:
    """A line that ran (either file): its answer as OpenAI writes it."""
    return {
        "id": line_request_id(batch_id, custom_id),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def never_ran_line(batch_id: str, custom_id: str, code: str) -> dict[str, Any]:
    """A line that never ran (expired or cancelled), for the error file."""
    return {
        "id": line_request_id(batch_id, custom_id),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": NEVER_RAN_MESSAGES.get(code, code)},
    }


def next_status(current: BatchStatus, wanted: BatchStatus) -> BatchStatus:
    """The status a batch in ``current`` takes when the workflow asks for
    ``wanted``: a terminal status never changes, and a batch being cancelled
    stays ``cancelling`` until it is ``cancelled`` (or ends otherwise)."""
    if current in TERMINAL_BATCH:
        return current
    if current is BatchStatus.CANCELLING and wanted in (
        BatchStatus.IN_PROGRESS,
        BatchStatus.FINALIZING,
        BatchStatus.VALIDATING,
    ):
        return current
    return wanted
