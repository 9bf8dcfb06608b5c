"""One file over HTTP into a partial file, resumed with Range, hashed as bytes arrive.

The partial (``<n>.part``) is written as bytes arrive (body.py: within
``body.HOLD_S``, or sooner), so what was received is in it when the process
dies; beside it ``<n>.part.json`` holds the validator (ETag) the bytes came
with. A resume hashes the partial again (a hash's state cannot be
saved) and asks for ``Range: bytes=N-``: a 206 with the same ETag and total size
continues it; a 200 (the server ignored the Range) or a changed ETag or size
starts again from zero. The caller renames the file into place once it is
verified; this module never leaves an unverified file under a final name.

An ETag is one source's name for its bytes: a partial begun at one source (a
peer) and resumed at another (the origin) is continued on the pin alone (size,
then the digest at the end), since the two never share ETags.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from worker_agent.fetch.body import BodySink, BodyTooLong, receive
from worker_agent.fetch.errors import (
    FetchDeadline,
    FetchStalled,
    FileMismatch,
    SourceRefused,
    SourceUnavailable,
)
from worker_agent.fetch.progress import ProgressMeter
from worker_agent.fetch.spec import ORIGIN, FetchPolicy, FileSpec

log = logging.getLogger(__name__)

NEVER_RETRIED = frozenset({401, 403, 404, 410})
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def shown(url: str) -> str:
    """A URL fit for a message: no query (a signed URL's signature) or userinfo."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}{parts.path}"


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds; the HTTP-date form is rare from hubs and read as absent."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class _Partial:
    """The partial file and its validator."""

    def __init__(self, part: Path) -> None:
        self.part = part
        self.meta = part.with_name(part.name + ".json")

    def etag(self, source: str) -> str | None:
        """The ETag the bytes came with, if they came from ``source`` (a partial
        from before sources were recorded came from the origin)."""
        try:
            meta = json.loads(self.meta.read_text())
            value, came_from = meta.get("etag"), meta.get("source", ORIGIN)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and came_from == source else None

    def set_etag(self, etag: str | None, source: str) -> None:
        tmp = self.meta.with_name(self.meta.name + ".tmp")
        tmp.write_text(json.dumps({"etag": etag, "source": source}))
        os.replace(tmp, self.meta)

    def rehash(self, spec: FileSpec, chunk_bytes: int) -> tuple[int, "hashlib._Hash"]:
        digest = spec.hasher()
        have = 0
        with contextlib.suppress(FileNotFoundError), self.part.open("rb") as reader:
            while chunk := reader.read(chunk_bytes):
                digest.update(chunk)
                have += len(chunk)
        return have, digest

    def discard(self) -> None:
        for path in (self.part, self.meta):
            path.unlink(missing_ok=True)


def _check_status(spec: FileSpec, response: httpx.Response) -> None:
    status = response.status_code
    if status in (200, 206):
        return
    where = f"{spec.rel_path} from {shown(str(response.url))}"
    if status in NEVER_RETRIED:
        raise SourceRefused(f"{where}: HTTP {status}", status=status)
    if status == 429 or status >= 500:
        retry_after = _retry_after(response.headers.get("retry-after"))
        raise SourceUnavailable(f"{where}: HTTP {status}", retry_after_s=retry_after)
    raise SourceRefused(f"{where}: unexpected HTTP {status}", status=status)


def _resumes(response: httpx.Response, have: int, size: int, etag: str | None) -> bool:
    """Whether a 206 continues our bytes: the range we asked, the size and the ETag we had."""
    match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", ""))
    if match is None or int(match[1]) != have or int(match[3]) != size:
        return False
    return etag is None or response.headers.get("etag") == etag


def attempt(
    client: httpx.Client,
    spec: FileSpec,
    part: Path,
    policy: FetchPolicy,
    meter: ProgressMeter,
    deadline: float | None,
    *,
    source: str = ORIGIN,
) -> bool:
    """One request to ``source`` (whose URL and headers ``spec`` holds); True if
    the partial is now the whole verified file.

    Raises the classified errors; returns False when the body ended early (the
    caller resumes). Bytes moved are reported to ``meter`` as they arrive.
    """
    partial = _Partial(part)
    have, digest = partial.rehash(spec, policy.chunk_bytes)
    etag = partial.etag(source) if have else None
    if have > spec.size:
        partial.discard()
        have, digest = 0, spec.hasher()
    meter.at(have)
    if have < spec.size:
        have, digest = _receive(
            client, spec, partial, _Got(have, digest), etag, source, policy, meter, deadline
        )
    if have < spec.size:
        return False
    got = digest.hexdigest()
    if got != spec.digest:
        partial.discard()
        meter.at(0)
        raise FileMismatch(spec.rel_path, spec.digest, kind=spec.digest_kind.value, got=got)
    partial.meta.unlink(missing_ok=True)
    return True


def _receive(
    client: httpx.Client,
    spec: FileSpec,
    partial: _Partial,
    state: "_Got",
    etag: str | None,
    source: str,
    policy: FetchPolicy,
    meter: ProgressMeter,
    deadline: float | None,
) -> tuple[int, "hashlib._Hash"]:
    have = state.have
    headers = dict(spec.headers())
    headers["Accept-Encoding"] = "identity"  # the digest is of the stored bytes
    if have:
        headers["Range"] = f"bytes={have}-"
    read_s = policy.stall_s
    if deadline is not None:
        read_s = max(0.001, min(read_s, deadline - time.monotonic()))
    timeout = httpx.Timeout(read_s, connect=policy.connect_timeout_s)
    try:
        with client.stream("GET", spec.url, headers=headers, timeout=timeout) as response:
            _check_status(spec, response)
            if not (
                have and response.status_code == 206 and _resumes(response, have, spec.size, etag)
            ):
                _restart(spec, partial, response, have, meter)
                state = _Got(0, spec.hasher())
            partial.set_etag(response.headers.get("etag"), source)
            _write_body(spec, partial, response, state, policy, meter, deadline, read_s)
    except httpx.TimeoutException as exc:
        if deadline is not None and time.monotonic() >= deadline:
            raise FetchDeadline(f"{spec.rel_path}: the fetch's deadline passed") from None
        if isinstance(exc, httpx.ReadTimeout):
            raise FetchStalled(
                f"{spec.rel_path}: no byte for {policy.stall_s:g}s from {shown(spec.url)}"
            ) from None
        raise _unavailable(spec, exc) from None
    except httpx.TransportError as exc:
        # from None: an httpx error's context may carry the request, and so its headers.
        raise _unavailable(spec, exc) from None
    return state.have, state.digest


@dataclass
class _Got:
    """The bytes of the partial so far and their running hash."""

    have: int
    digest: "hashlib._Hash"


def _unavailable(spec: FileSpec, exc: Exception) -> SourceUnavailable:
    return SourceUnavailable(f"{spec.rel_path}: {type(exc).__name__} from {shown(spec.url)}")


def _restart(
    spec: FileSpec, partial: _Partial, response: httpx.Response, have: int, meter: ProgressMeter
) -> None:
    """Start the partial again from zero for a whole-file answer."""
    if have:
        log.info("%s: the source did not resume its bytes, fetching again from 0", spec.rel_path)
        meter.at(0)
    if response.status_code == 206:  # another ETag or size, or a range we did not ask for
        partial.discard()
        raise SourceUnavailable(f"{spec.rel_path}: the source's file changed; fetching it again")
    with partial.part.open("wb"):
        pass


def _write_body(
    spec: FileSpec,
    partial: _Partial,
    response: httpx.Response,
    state: "_Got",
    policy: FetchPolicy,
    meter: ProgressMeter,
    deadline: float | None,
    read_s: float,
) -> None:
    length = response.headers.get("content-length", "")
    if length.isdigit() and state.have + int(length) != spec.size:
        # Known wrong before a byte is read: the source holds another file than the pin.
        partial.discard()
        meter.at(0)
        got = f"a file of {state.have + int(length)} bytes, not {spec.size}"
        raise FileMismatch(spec.rel_path, spec.digest, kind=spec.digest_kind.value, got=got)
    fd = os.open(partial.part, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    try:

        def received(moved: int) -> None:
            state.have += moved
            meter.at(state.have, moved)
            if deadline is not None and time.monotonic() > deadline:
                raise FetchDeadline(f"{spec.rel_path}: the fetch's deadline passed")

        try:
            # Leaving the with waits for the writer: every byte received is in the
            # partial, and the digest is whole, before anything reads them.
            with BodySink(fd, state.have, state.digest, policy.chunk_bytes) as sink:
                receive(
                    response,
                    sink,
                    limit=spec.size - state.have,
                    buffer_bytes=policy.chunk_bytes,
                    timeout_s=read_s,
                    received=received,
                )
        except BodyTooLong:
            partial.discard()
            meter.at(0)
            raise FileMismatch(
                spec.rel_path,
                spec.digest,
                kind=spec.digest_kind.value,
                got=f"more than {spec.size} bytes",
            ) from None
        os.fsync(fd)  # before the rename that makes it final
    finally:
        os.close(fd)
