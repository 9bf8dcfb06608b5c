"""Pure decisions of the batch workflow (workflows/jobs_batch.py): which line
ranges run next, when a run continues as new, and how a batch ends. No
Temporal here: tests/control/test_jobs_rules.py."""

import enum

from llmgw.types import BatchStatus


class Ending(enum.Enum):
    """Why the workflow stopped scheduling lines."""

    DONE = "done"  # every line ran
    CANCELLED = "cancelled"  # the cancel signal
    EXPIRED = "expired"  # the completion window's timer
    CONTINUE = "continue"  # history is long: continue as new, lines left


def next_ranges(next_line: int, total: int, chunk_lines: int, free: int) -> list[tuple[int, int]]:
    """Up to ``free`` ranges of ``chunk_lines`` lines from ``next_line`` (1-based,
    inclusive ends), none past ``total``."""
    ranges: list[tuple[int, int]] = []
    first = next_line
    while len(ranges) < free and first <= total:
        last = min(total, first + chunk_lines - 1)
        ranges.append((first, last))
        first = last + 1
    return ranges


def may_schedule(chunks_done: int, running: int, max_chunks: int, suggested: bool) -> bool:
    """Whether this run schedules another chunk: not once it has run (or
    holds) ``max_chunks``, nor once Temporal suggests continuing as new."""
    return not suggested and chunks_done + running < max_chunks


def ending(next_line: int, total: int, cancelled: bool, expired: bool) -> Ending:
    """How a run ends once nothing runs: a cancel wins over expiry (the user
    asked), and lines left without either means continue as new."""
    if cancelled:
        return Ending.CANCELLED
    if expired:
        return Ending.EXPIRED
    return Ending.DONE if next_line > total else Ending.CONTINUE


# The statuses an ending goes through after its lines: (before finalize, the
# never-ran code for the error file, the final status).
FINISH: dict[Ending, tuple[BatchStatus | None, str, BatchStatus]] = {
    Ending.DONE: (BatchStatus.FINALIZING, "", BatchStatus.COMPLETED),
    Ending.CANCELLED: (BatchStatus.CANCELLING, "batch_cancelled", BatchStatus.CANCELLED),
    Ending.EXPIRED: (None, "batch_expired", BatchStatus.EXPIRED),
}


def seconds_left(expires_at: float, now: float) -> float:
    """Until the completion window ends (0: it has)."""
    return max(0.0, expires_at - now)
