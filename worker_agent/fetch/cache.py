"""Artifacts fetched into the weights cache: single flight, disk check, LRU budget.

See the package docstring for the layout on disk.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from llmgw.errors import ConfigError
from worker_agent.fetch.entry import MARKER, read_marker
from worker_agent.fetch.entry import fsync_dir as _fsync_dir
from worker_agent.fetch.entry import make_group_readable as _make_group_readable
from worker_agent.fetch.entry import set_mode as _set_mode
from worker_agent.fetch.entry import tree_digest as _tree_digest
from worker_agent.fetch.errors import DiskTooSmall
from worker_agent.fetch.progress import ProgressMeter, ProgressSink
from worker_agent.fetch.retry import fetch_file_from
from worker_agent.fetch.spec import ArtifactSpec, FetchPolicy, FileSpec, HeadersProvider

STAGING_PREFIX = ".staging-"
PARTS = ".parts"
# In a staging directory: what its files must be, so a peer server can serve
# the verified ones (and name their digests) before the entry is complete.
STAGING_MANIFEST = ".manifest.json"
USERS_SUFFIX = ".users"
_USER = re.compile(r"[A-Za-z0-9_.-]{1,200}")


@dataclass(frozen=True)
class FetchedArtifact:
    """A complete entry: ``path`` is its payload directory, files at their relative paths.

    ``bytes_by_source``: the bytes this call received from each source (the
    origin's name, peers' node ids); empty for a cache hit.
    """

    key: str
    path: Path
    sha256: str
    size_bytes: int
    cached: bool
    bytes_by_source: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def _flock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive flock on ``path``; yields False when ``wait`` is off and it is held.

    The lock file stays: unlinking it would let a waiter lock an orphaned inode
    while a newcomer locks a fresh file (as WeightsCache._locked).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class ArtifactCache:
    """Complete artifacts under ``root``, one ``root/<key>/`` entry each.

    ``budget_bytes``: the most the complete entries may hold together (None: no
    bound); before a fetch, entries least recently used and used by no one are
    evicted to make room. ``group``: the engine user's group (as WeightsCache).
    """

    def __init__(
        self,
        root: Path,
        *,
        policy: FetchPolicy | None = None,
        budget_bytes: int | None = None,
        group: int | None = None,
    ) -> None:
        self.root = root
        self.policy = policy or FetchPolicy()
        self.budget_bytes = budget_bytes
        self.group = group

    # -- use markers -------------------------------------------------------
    def _users(self, key: str) -> Path:
        return self.root / f"{key}{USERS_SUFFIX}"

    def release(self, key: str, user: str) -> None:
        """``user`` (a replica) no longer reads the entry: it may be evicted once unused."""
        with _flock(self.root / f"{key}.lock"):
            (self._users(key) / _checked_user(user)).unlink(missing_ok=True)
            self._touch(key)

    def users(self, key: str) -> list[str]:
        try:
            return sorted(p.name for p in self._users(key).iterdir())
        except FileNotFoundError:
            return []

    # -- lookup ------------------------------------------------------------
    def lookup(self, key: str) -> FetchedArtifact | None:
        """The complete entry ``key``: its marker read whole and its payload present."""
        found = read_marker(self.root / key)
        if found is None or not found[0].is_dir():
            return None
        payload, sha, size = found
        return FetchedArtifact(key, payload, sha, size, cached=True)

    def _touch(self, key: str) -> None:
        """Last use is the entry's mtime, which eviction orders by."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.root / key)

    # -- fetch -------------------------------------------------------------
    def fetch(
        self,
        artifact: ArtifactSpec,
        *,
        user: str | None = None,
        progress: ProgressSink | None = None,
        client: httpx.Client | None = None,
    ) -> FetchedArtifact:
        """The artifact from the cache, fetched on a miss; ``user`` (a replica id)
        is recorded as using it, so it is not evicted until ``release``."""
        key = artifact.key
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = None
        if self.policy.deadline_s is not None:
            deadline = time.monotonic() + self.policy.deadline_s
        # One fetch of a key at a time on the node: a second one waits here, then finds it.
        with _flock(self.root / f"{key}.lock"):
            marker = None if user is None else self._users(key) / _checked_user(user)
            added = marker is not None and not marker.exists()
            if marker is not None:
                marker.parent.mkdir(exist_ok=True)
                marker.touch()
                _fsync_dir(marker.parent)
            try:
                hit = self.lookup(key)
                if hit is not None:
                    self._touch(key)
                    return hit
                self.evict(need_bytes=artifact.total_bytes, keep={key})
                return self._fill(artifact, progress, client, deadline)
            except BaseException:
                if added and marker is not None:  # a failed fetch leaves no use behind
                    marker.unlink(missing_ok=True)
                raise

    def _fill(
        self,
        artifact: ArtifactSpec,
        progress: ProgressSink | None,
        client: httpx.Client | None,
        deadline: float | None,
    ) -> FetchedArtifact:
        key = artifact.key
        staging = self.root / f"{STAGING_PREFIX}{key}"
        payload = staging / artifact.name
        parts = staging / PARTS
        pending = [f for f in artifact.files if not _is_final(payload / f.rel_path, f.size)]
        had = sum(_size(parts / part_name(f.rel_path)) for f in pending)
        left = sum(f.size for f in pending) - had
        needed = left + self.policy.disk_margin_bytes
        free = _free_bytes(self.root)
        if free < needed:
            raise DiskTooSmall(needed, free, str(self.root))
        parts.mkdir(parents=True, exist_ok=True)
        _write_json(staging / STAGING_MANIFEST, _files_json(artifact))
        meter = ProgressMeter(
            progress,
            files_total=len(artifact.files),
            bytes_total=artifact.total_bytes,
            source=artifact.source,
            interval_s=self.policy.progress_interval_s,
        )
        for f in artifact.files:
            if f not in pending:
                meter.file_done(f.size)
        owned = client is None
        http = client or httpx.Client(follow_redirects=True)
        skip: set[str] = set()  # peers found dead, refusing or lying
        try:
            for f in pending:
                part = parts / part_name(f.rel_path)
                peers = [
                    (p.name, _at_peer(f, p.file_url(key, f.rel_path), p.headers))
                    for p in artifact.peers
                ]
                fetch_file_from(
                    http, peers, (artifact.source, f), part, self.policy, meter, deadline, skip=skip
                )
                final = payload / f.rel_path
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, final)  # verified and fsynced: only now under its name
                _fsync_dir(final.parent)
                meter.file_done(f.size)
        finally:
            if owned:
                http.close()
        done = self._complete(artifact, staging)
        return replace(done, bytes_by_source=dict(meter.bytes_by_source))

    def _complete(self, artifact: ArtifactSpec, staging: Path) -> FetchedArtifact:
        key = artifact.key
        shutil.rmtree(staging / PARTS, ignore_errors=True)
        (staging / STAGING_MANIFEST).unlink(missing_ok=True)
        _make_group_readable(staging, self.group)  # fsyncs every directory too
        sha = _tree_digest({f.rel_path: f.digest for f in artifact.files})
        marker = {
            "name": artifact.name,
            "sha256": sha,
            "size": artifact.total_bytes,
            "files": _files_json(artifact)["files"],
            "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        # Written last: its presence is what makes the entry complete.
        with (staging / MARKER).open("w") as out:
            json.dump(marker, out)
            out.flush()
            os.fsync(out.fileno())
        _set_mode(staging / MARKER, 0o640, self.group)
        _fsync_dir(staging)
        entry = self.root / key
        shutil.rmtree(entry, ignore_errors=True)  # an incomplete leftover: we hold its lock
        os.replace(staging, entry)
        _fsync_dir(self.root)
        return FetchedArtifact(key, entry / artifact.name, sha, artifact.total_bytes, cached=False)

    # -- eviction ----------------------------------------------------------
    def evict(self, *, need_bytes: int = 0, keep: set[str] | None = None) -> list[str]:
        """Evict least recently used entries no one uses until the complete ones and
        ``need_bytes`` fit the budget; returns the keys evicted. An entry being
        fetched or used (a use marker) is never evicted; if they alone pass the
        budget, the budget is passed."""
        if self.budget_bytes is None:
            return []
        keep = keep or set()
        entries = []
        for entry in self.root.iterdir():
            hit = None if entry.name.startswith(".") else self.lookup(entry.name)
            if hit is not None:
                with contextlib.suppress(FileNotFoundError):  # evicted by another process
                    entries.append((entry.stat().st_mtime_ns, hit))
        held = sum(hit.size_bytes for _, hit in entries)
        evicted: list[str] = []
        for _, hit in sorted(entries, key=lambda item: item[0]):
            if held + need_bytes <= self.budget_bytes:
                break
            if hit.key in keep:
                continue
            with _flock(self.root / f"{hit.key}.lock", wait=False) as locked:
                if not locked or self.users(hit.key):
                    continue
                # Renamed first, so the entry stops being complete in one step.
                doomed = self.root / f".evicted-{hit.key}-{os.getpid()}"
                os.replace(self.root / hit.key, doomed)
                _fsync_dir(self.root)
                shutil.rmtree(doomed, ignore_errors=True)
                shutil.rmtree(self._users(hit.key), ignore_errors=True)
            held -= hit.size_bytes
            evicted.append(hit.key)
        return evicted


def _files_json(artifact: ArtifactSpec) -> dict[str, object]:
    """The pin of each file, as the marker and the staging manifest hold it."""
    return {
        "name": artifact.name,
        "files": {
            f.rel_path: {"size": f.size, "digest": f.digest, "kind": f.digest_kind.value}
            for f in artifact.files
        },
    }


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _at_peer(spec: FileSpec, url: str, headers: HeadersProvider) -> FileSpec:
    return replace(spec, url=url, headers=headers)


def _checked_user(user: str) -> str:
    if not _USER.fullmatch(user) or user in (".", ".."):
        raise ConfigError(f"a cache user must be a plain name, not {user!r}")
    return user


def part_name(rel_path: str) -> str:
    """The partial of ``rel_path`` under ``.parts/`` (a flat name: no directories to make)."""
    return hashlib.sha256(rel_path.encode()).hexdigest()[:32] + ".part"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _is_final(path: Path, size: int) -> bool:
    """A file under its final name in the staging dir was verified and fsynced
    before its rename, so its size is enough to know it is done."""
    try:
        return path.stat().st_size == size
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise
