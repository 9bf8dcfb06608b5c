"""Trying one file again: backoff for what may pass, never for a refusal.

Retried: ``SourceUnavailable`` (connection errors, 5xx, 429 after its
Retry-After, stalls) and a body that ended early, with backoff; a
``FileMismatch`` (the partial is deleted, so the next try starts from zero).
A try that took the partial further than any before resets the count of
failures in a row, so a link that drops every few minutes still finishes a
large file, while one that restarts from zero each time still ends;
mismatches are counted on their own and never reset. ``SourceRefused`` and ``FetchDeadline`` end the
fetch at once.

Peers come first, one try each: whatever a peer does wrong (refuses, lacks
the file, dies mid-copy, stalls, sends bytes that do not verify) moves on to
the next source, the partial kept unless its bytes were wrong; the origin is
last, with the retries above.
"""

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from worker_agent.fetch.errors import (
    FetchDeadline,
    FileMismatch,
    SourceRefused,
    SourceUnavailable,
)
from worker_agent.fetch.http_file import attempt
from worker_agent.fetch.progress import ProgressMeter
from worker_agent.fetch.spec import ORIGIN, FetchPolicy, FileSpec

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
    *,
    source: str = ORIGIN,
) -> None:
    """Leave the verified, fsynced file at ``part`` or raise the last error."""
    failures = 0
    mismatches = 0
    best = _part_size(part)
    while True:
        delay: float | None = None
        try:
            if attempt(client, spec, part, policy, meter, deadline, source=source):
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


def fetch_file_from(
    client: httpx.Client,
    peers: Sequence[tuple[str, FileSpec]],
    origin: tuple[str, FileSpec],
    part: Path,
    policy: FetchPolicy,
    meter: ProgressMeter,
    deadline: float | None,
    *,
    skip: set[str] | None = None,
) -> None:
    """``fetch_file`` from the first source that delivers the verified file:
    each of ``peers`` (node id, the file at that peer) once, then ``origin``.

    ``skip``: peers not to ask, shared across an artifact's files. A peer that
    fails in any way is added: a dead node costs one connect per artifact, not
    one per file, and one that lacks a file lacks the artifact (the same key
    is the same files; a peer fetching it waits for a file not reached yet).
    """
    skip = set() if skip is None else skip
    window = min(policy.stall_s, policy.peer_stall_s)
    at_peer = dataclasses.replace(
        policy, stall_s=window, connect_timeout_s=min(policy.connect_timeout_s, window)
    )
    for name, spec in peers:
        if name in skip:
            continue
        meter.use(name)
        try:
            if attempt(client, spec, part, at_peer, meter, deadline, source=name):
                return
            log.info("%s: peer %s ended the body early; next source", spec.rel_path, name)
        except (SourceUnavailable, SourceRefused, FileMismatch) as exc:
            log.info("peer %s: %s; next source", name, exc)
        skip.add(name)
    name, spec = origin
    meter.use(name)
    fetch_file(client, spec, part, policy, meter, deadline, source=name)
