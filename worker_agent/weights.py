"""Fetching a model's weights into the node's weights cache before an engine starts.

Why a per-node cache rather than pointing engines at the source:

- Engines read weights only from here. The cache is under the agent's work dir and is
  readable by the engine user's group but not the world (dirs 0750, files 0640, group
  the engine user's), so engines run as a non-root user and other local users see
  nothing.
- A complete entry (one with its ``COMPLETE`` marker) survives an agent or node restart
  and is served again without copying hundreds of GiB.
- Every copy is checksummed as it is written, so a truncated or corrupt copy is caught
  here rather than as an engine crash or silently wrong output.

Only local sources (an absolute path or a ``file://`` URL) are supported today, and only
inside the configured roots (``Roots``: ``LLMGW_WEIGHTS_ROOTS``). Remote
sources (an object store, a model hub) will plug in later as another ``WeightSource``;
until then ``source_for`` refuses them. The code is synchronous and knows nothing of
Temporal: the caller runs ``fetch`` in a thread and turns progress into heartbeats.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol
from urllib.parse import unquote, urlsplit

from worker_agent.fetch.entry import MARKER, ChecksumMismatch, WeightsError, read_marker
from worker_agent.fetch.entry import fsync_dir as _fsync_dir
from worker_agent.fetch.entry import make_group_readable as _make_group_readable
from worker_agent.fetch.entry import set_mode as _set_mode
from worker_agent.fetch.entry import tree_digest as _tree_digest

# Re-exported from the fetch package's floor: the agent's activities and tests
# name them here.
__all__ = ["MARKER", "ChecksumMismatch", "WeightsError", "read_marker"]

Progress = Callable[[int, int], None]
"""Called with (bytes_done, bytes_total)."""

CHUNK_BYTES = 2**20
KEY_HEX_CHARS = 24


class UnsupportedSource(WeightsError):
    """The URI names a kind of source this agent cannot fetch from."""

    retryable = False


class SourceMissing(WeightsError):
    """The source path does not exist."""

    retryable = False


class SourceOutsideRoots(WeightsError):
    """The source, or a file reached through it, resolves outside the weights roots."""

    retryable = False


ROOTS_SETTING = "LLMGW_WEIGHTS_ROOTS"


@dataclass(frozen=True)
class Roots:
    """The directories weights (and LoRA adapters) may be read from.

    The agent reads what the catalog names, often as root, and copies it where
    engines can read it: unbounded, whoever writes the catalog could read any
    file of the node (``/etc/shadow`` as a model, or a model directory holding a
    link to it). A path is inside once every symlink in it is resolved, so a
    link inside a root that points out of it is refused.
    """

    dirs: tuple[Path, ...]

    @classmethod
    def of(cls, dirs: Sequence[Path]) -> "Roots":
        """Roots from a list of directories."""
        return cls(tuple(dirs))

    def inside(self, path: Path | str) -> Path:
        """``path`` with every link resolved, once it lies in a root; SourceOutsideRoots if not."""
        real = Path(os.path.realpath(path))
        # Resolved now, not once: a root may be created (or be a link) after startup.
        if any(real.is_relative_to(os.path.realpath(d)) for d in self.dirs):
            return real
        allowed = ", ".join(str(d) for d in self.dirs) or "none"
        shown = str(path) if str(path) == str(real) else f"{path} (resolving to {real})"
        raise SourceOutsideRoots(
            f"{shown} is outside the weights roots ({allowed}); {ROOTS_SETTING} lists the"
            " directories weights and adapters may be read from"
        )

    def open(self, path: Path) -> BinaryIO:
        """``path`` opened for reading, checked where the open landed: a link
        swapped in after an earlier check cannot lead the read out."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                landed = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # no /proc: the path as it resolves now
                landed = str(path)
            self.inside(landed)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")


@dataclass(frozen=True)
class FetchedWeights:
    """Weights in the cache, ready for an engine to load."""

    path: Path
    sha256: str
    size_bytes: int
    cached: bool


@dataclass(frozen=True)
class SourceInfo:
    """What a source is, cheaply: ``identity`` changes whenever the content may have."""

    identity: str
    size_bytes: int
    is_dir: bool


class WeightSource(Protocol):
    """Somewhere weights can be copied from."""

    def describe(self) -> SourceInfo:
        """Identify the source without reading its content; raise SourceMissing if absent."""
        ...

    def copy_into(self, dest: Path, progress: Progress) -> str | None:
        """Write the weights at ``dest`` (a file or a directory), reporting progress.

        Return the digest if it was computed while writing (saves reading everything a
        second time); return None and the cache reads the copy back to compute it.
        """
        ...


def _regular_files(
    root: Path, roots: Roots | None = None
) -> list[tuple[str, Path, os.stat_result]]:
    """(posix relpath, path, stat) of each regular file at or under ``root``, by relpath.

    Symlinks are followed (HF snapshot dirs link into a blob store), but with ``roots``
    only within them (SourceOutsideRoots). A directory that is its own ancestor through
    links is not entered again, so a link loop cannot hang us.
    """
    if not root.is_dir():
        return [(root.name, root, root.stat())]
    found: list[tuple[str, Path, os.stat_result]] = []
    above: dict[str, frozenset[tuple[int, int]]] = {}  # dirpath -> (dev, ino) of its chain
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        if roots is not None:
            roots.inside(dirpath)  # before listing a directory a link led to
        st = os.stat(dirpath)
        chain = above.get(os.path.dirname(dirpath), frozenset())
        if (st.st_dev, st.st_ino) in chain:
            dirnames[:] = []
            continue
        above[dirpath] = chain | {(st.st_dev, st.st_ino)}
        for name in filenames:
            path = Path(dirpath) / name
            try:
                file_st = path.stat()
            except FileNotFoundError:  # a dangling symlink is not part of the model
                continue
            if roots is not None:
                roots.inside(path)
            if stat.S_ISREG(file_st.st_mode):
                found.append((path.relative_to(root).as_posix(), path, file_st))
    found.sort(key=lambda item: item[0])
    return found


def _copy_file(src: Path, dst: Path, on_bytes: Callable[[int], None], roots: Roots) -> str:
    """Copy in 1 MiB chunks, hashing as we go.

    The copy is fsynced: the marker written after it must not reach the disk first.
    """
    digest = hashlib.sha256()
    with roots.open(src) as reader, dst.open("wb") as writer:
        while chunk := reader.read(CHUNK_BYTES):
            digest.update(chunk)
            writer.write(chunk)
            on_bytes(len(chunk))
        writer.flush()
        os.fsync(writer.fileno())
    return digest.hexdigest()


def _digest_path(path: Path) -> str:
    """Digest of a copy already on disk, for sources that do not hash while writing."""
    shas: dict[str, str] = {}
    for rel, file, _ in _regular_files(path):
        digest = hashlib.sha256()
        with file.open("rb") as reader:
            while chunk := reader.read(CHUNK_BYTES):
                digest.update(chunk)
        shas[rel] = digest.hexdigest()
    return _tree_digest(shas) if path.is_dir() else shas[path.name]


class LocalSource:
    """A file or directory on a filesystem this node can read, inside ``roots``."""

    def __init__(self, path: Path, roots: Roots) -> None:
        self.path = path
        self.roots = roots

    def describe(self) -> SourceInfo:
        """Identity is resolved path + size + mtime(s): a rewritten source is fetched again."""
        try:
            resolved = self.path.resolve(strict=True)
            st = resolved.stat()
        except FileNotFoundError as exc:
            raise SourceMissing(f"weights source {self.path} does not exist") from exc
        self.roots.inside(resolved)
        if stat.S_ISREG(st.st_mode):
            return SourceInfo(f"file:{resolved}:{st.st_size}:{st.st_mtime_ns}", st.st_size, False)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsupportedSource(f"weights source {self.path} is not a file or directory")
        # A directory's own mtime misses files rewritten in place, so fold in every file's.
        listing = hashlib.sha256()
        size = 0
        for rel, _, file_st in _regular_files(resolved, self.roots):
            listing.update(f"{rel}\0{file_st.st_size}\0{file_st.st_mtime_ns}\n".encode())
            size += file_st.st_size
        return SourceInfo(f"dir:{resolved}:{size}:{listing.hexdigest()}", size, True)

    def copy_into(self, dest: Path, progress: Progress) -> str:
        """Copy the file or tree to ``dest`` and return its digest, computed while copying."""
        src = self.roots.inside(self.path.resolve(strict=True))
        files = _regular_files(src, self.roots)
        total = sum(st.st_size for _, _, st in files)
        done = 0

        def on_bytes(count: int) -> None:
            nonlocal done
            done += count
            progress(done, total)

        if not src.is_dir():
            return _copy_file(src, dest, on_bytes, self.roots)
        dest.mkdir()
        shas: dict[str, str] = {}
        for rel, path, _ in files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shas[rel] = _copy_file(path, target, on_bytes, self.roots)
        return _tree_digest(shas)


def source_for(uri: str, roots: Roots) -> WeightSource:
    """Plain absolute path or file:// URL → LocalSource in ``roots``; anything else →
    UnsupportedSource."""
    parts = urlsplit(uri)
    if uri.startswith("/"):
        return LocalSource(Path(uri), roots)
    if parts.scheme == "file":
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise UnsupportedSource(f"file URL {uri!r} must name an absolute local path")
        return LocalSource(Path(path), roots)
    if not parts.scheme:
        raise UnsupportedSource(f"weights path {uri!r} must be absolute")
    raise UnsupportedSource(
        f"remote source {uri!r} has no pin: nodes fetch a remote source at the revision"
        " `llmgw model apply` pinned it to (an entry written without it, e.g. by"
        " PUT /admin/models, must be applied again)"
    )


class _Throttle:
    """Forwards progress at start, every ``every`` bytes, and at the end, no more often.

    Sources report every chunk; a heartbeat per MiB would swamp Temporal.
    """

    def __init__(self, sink: Progress | None, every: int) -> None:
        self._sink = sink
        self._every = every
        self._sent: int | None = None

    def __call__(self, done: int, total: int) -> None:
        due = self._sent is None or done >= total or done - self._sent >= self._every
        if self._sink is not None and due and done != self._sent:
            self._sent = done
            self._sink(done, total)


def _payload_name(uri: str) -> str:
    return PurePosixPath(unquote(urlsplit(uri).path)).name or "weights"


class WeightsCache:
    """Weights cached under ``root``, one ``root/<key>/`` entry per source identity."""

    def __init__(
        self,
        root: Path,
        roots: Sequence[Path],
        progress_every_bytes: int = 64 * 2**20,
        group: int | None = None,
    ) -> None:
        """``roots``: the only directories sources may lie in (``LLMGW_WEIGHTS_ROOTS``).
        ``group``: the engine user's group, which may read the cache (None: the
        agent's own group)."""
        self.root = root
        self.roots = Roots.of(roots)
        self.progress_every_bytes = progress_every_bytes
        self.group = group

    def fetch(
        self, uri: str, expected_sha256: str | None = None, progress: Progress | None = None
    ) -> FetchedWeights:
        """Return the weights at ``uri`` from the cache, copying them in on a miss."""
        # Checked before the cache is looked at: an entry copied while a root
        # allowed it is not served once the roots no longer do.
        source = source_for(uri, self.roots)
        info = source.describe()
        key = hashlib.sha256(info.identity.encode()).hexdigest()[:KEY_HEX_CHARS]
        expected = expected_sha256.strip().lower() if expected_sha256 else None
        self.root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):  # a root we do not own is set up already
            _set_mode(self.root, 0o750, self.group)
        with self._locked(key):
            hit = self._lookup(key)
            if hit is None:
                return self._fill(key, uri, source, info, expected, progress)
            if expected is not None and hit.sha256 != expected:
                raise ChecksumMismatch(
                    f"weights {uri}: expected sha256 {expected}, cached copy has {hit.sha256}"
                )
            self._align_modes(self.root / key)
            return hit

    def _align_modes(self, entry: Path) -> None:
        """Bring an entry made by an older agent (0755/0644) or for another engine
        group to this cache's modes."""
        st = entry.stat()
        if stat.S_IMODE(st.st_mode) != 0o750 or (
            self.group is not None and st.st_gid != self.group
        ):
            _make_group_readable(entry, self.group)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Serialise fetches of one source, across threads and processes alike.

        flock locks belong to an open file description, so two threads that each open
        the file exclude each other. The lock file is left behind: unlinking it would let
        a waiter lock an orphaned inode while a newcomer locks a fresh file.
        """
        fd = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _lookup(self, key: str) -> FetchedWeights | None:
        """A complete entry: marker readable and payload present. Anything less is a miss."""
        found = read_marker(self.root / key)
        if found is None:
            return None
        payload, sha, size = found
        return FetchedWeights(payload, sha, size, cached=True)

    def _fill(
        self,
        key: str,
        uri: str,
        source: WeightSource,
        info: SourceInfo,
        expected: str | None,
        progress: Progress | None,
    ) -> FetchedWeights:
        """Copy into a temp dir beside the entry, verify, then rename it into place."""
        entry = self.root / key
        # Leftovers of a crashed fetch of this key; we hold its lock, so nobody is using them.
        shutil.rmtree(entry, ignore_errors=True)
        for stale in self.root.glob(f".tmp-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        # Same filesystem as the entry, so the final os.replace is an atomic rename.
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root))
        name = _payload_name(uri)
        try:
            throttle = _Throttle(progress, self.progress_every_bytes)
            throttle(0, info.size_bytes)
            sha = source.copy_into(tmp / name, throttle) or _digest_path(tmp / name)
            if expected is not None and sha != expected:
                raise ChecksumMismatch(f"weights {uri}: expected sha256 {expected}, got {sha}")
            size = sum(st.st_size for _, _, st in _regular_files(tmp / name))
            throttle(size, size)  # a no-op unless the source never reported its end
            _make_group_readable(tmp, self.group)
            marker = {"uri": uri, "name": name, "sha256": sha, "size": size}
            marker["fetched_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            # Written last: its presence is what makes the entry complete.
            with (tmp / MARKER).open("w") as out:
                json.dump(marker, out)
                out.flush()
                os.fsync(out.fileno())
            _set_mode(tmp / MARKER, 0o640, self.group)
            _fsync_dir(tmp)
            os.replace(tmp, entry)
            _fsync_dir(self.root)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise WeightsError(f"fetching weights {uri} failed: {exc}") from exc
            raise
        return FetchedWeights(entry / name, sha, size, cached=False)
