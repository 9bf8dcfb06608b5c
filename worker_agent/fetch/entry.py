"""A cache entry on disk, as both caches of a node write it: the local
sources' (worker_agent/weights.py) and fetched artifacts' (cache.py here).

An entry ``<root>/<key>/`` is complete only with its ``COMPLETE`` marker,
written, fsynced and renamed into place last; its files are group-readable
by the engine user. This module is the fetch package's floor: it imports
nothing of the agent, so the agent's modules may import the package.
"""

import hashlib
import json
import os
from pathlib import Path

from llmgw.errors import LlmgwError

MARKER = "COMPLETE"


class WeightsError(LlmgwError):
    """A weights fetch failed; ``retryable`` tells the caller whether trying again can help."""

    retryable: bool = True


class ChecksumMismatch(WeightsError):
    """The weights' digest is not the one the caller expected."""

    retryable = False


def read_marker(entry: Path) -> tuple[Path, str, int] | None:
    """A cache entry's completion marker (written last: its payload's name,
    tree digest and size) and the payload it names, when both are there and
    whole; anything less is ``None``, a miss. The one reader of the marker:
    the node's local copies (``WeightsCache``) and fetched artifacts
    (worker_agent/fetch/cache.py) share the format."""
    try:
        marker = json.loads((entry / MARKER).read_text())
        name, sha, size = marker["name"], marker["sha256"], marker["size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(name, str) and isinstance(sha, str) and isinstance(size, int)):
        return None
    if not name or not (entry / name).exists():
        return None
    return entry / name, sha, size


def tree_digest(file_shas: dict[str, str]) -> str:
    """Directory digest: sha256 over sorted "relpath\\0filesha\\n" lines."""
    digest = hashlib.sha256()
    for rel in sorted(file_shas):
        digest.update(f"{rel}\0{file_shas[rel]}\n".encode())
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the names in it durable, not just the files' bytes
    finally:
        os.close(fd)


def make_group_readable(root: Path, group: int | None) -> None:
    """Dirs 0750, files 0640, owned by ``group`` when given (the engine user's), and
    fsync the dirs."""
    for dirpath, _, filenames in os.walk(root):
        set_mode(dirpath, 0o750, group)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):  # chmod would follow it out of the cache
                set_mode(path, 0o640, group)
        fsync_dir(Path(dirpath))


def set_mode(path: str | Path, mode: int, group: int | None) -> None:
    if group is not None:
        os.chown(path, -1, group)
    os.chmod(path, mode)
