"""Trying one file again: backoff for what may pass, never for a refusal.

Retried: ``SourceUnavailable`` (connection errors, 5xx, 429 after its
Retry-After, stalls) and a body that ended early, with backoff; a
``FileMismatch`` (the partial is deleted, so the next try starts from zero).
A try that took the partial further than any before resets the count of
failures in a row, so a link that drops every few minutes still finishes a
large file, while one that restarts from zero each time still ends;
mismatches are counted on their own and never reset. ``SourceRefused`` and ``FetchDeadline`` end the
fetch at once.
"""

import logging
import time
from pathlib import Path

import httpx

from worker_agent.fetch.errors import FetchDeadline, FileMismatch, SourceUnavailable
from worker_agent.fetch.http_file import attempt
from worker_agent.fetch.progress import ProgressMeter
from worker_agent.fetch.spec import FetchPolicy, FileSpec

log = logging.getLogger(__name__)


def _part_size(part: Path) -> int:
    try:
        return part.stat().st_size
    except FileNotFoundError:
        return 0


def fetch_file(
    client: httpx.Client,
    spec: FileSpec,
    part: Path,
    policy: FetchPolicy,
    meter: ProgressMeter,
    deadline: float | None,
) -> None:
    """Leave the verified, fsynced file at ``part`` or raise the last error."""
    failures = 0
    mismatches = 0
    best = _part_size(part)
    while True:
        delay: float | None = None
        try:
            if attempt(client, spec, part, policy, meter, deadline):
                return
            error: Exception = SourceUnavailable(f"{spec.rel_path}: the body ended early")
        except FileMismatch as exc:
            mismatches += 1
            if mismatches >= policy.attempts:
                raise
            log.warning("%s; fetching it again from the source", exc)
            continue
        except SourceUnavailable as exc:
            error = exc
            delay = exc.retry_after_s
        if _part_size(part) > best:  # further than ever: not a failure in a row
            best = _part_size(part)
            failures = 0
        failures += 1
        if failures >= policy.attempts:
            raise error
        if delay is None:
            delay = min(policy.backoff_s * 2 ** (failures - 1), policy.max_backoff_s)
        else:
            delay = min(delay, policy.max_retry_after_s)
        if deadline is not None and time.monotonic() + delay >= deadline:
            raise FetchDeadline(
                f"{spec.rel_path}: the deadline passes before the next try ({error})"
            )
        log.info("%s; trying again in %.1fs", error, delay)
        time.sleep(delay)
