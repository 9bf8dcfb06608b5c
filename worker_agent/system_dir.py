"""The system directory: where what the engine user must reach goes when it
cannot reach the agent's work dir (a clone under root's 0700 home).

Split from worker_agent/users.py, which decides whom engines run as and calls
:func:`system_place` when that user cannot pass through to the work dir.
Everything here is made by root, checked before use and never reached
through a link: ``<LLMGW_SYSTEM_DIR>/<digest of the work dir>/agent/<node>``.
``make clean`` finds a clone's directories by their ``work-dir`` note.
"""

import contextlib
import hashlib
import os
import stat
from pathlib import Path

from llmgw.errors import EngineUserError


def system_base(system_dir: Path, work_dir: Path) -> Path:
    """This work dir's directory in ``system_dir``: one per work dir (a digest of
    its resolved path), so two clones on one host never share a home or cache."""
    digest = hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:16]
    return system_dir / digest


def system_place(system_dir: Path, work_dir: Path, node: str, group: int) -> Path:
    """``<system_dir>/<digest of the work dir>/agent/<node>``, made by root for the
    engine user's ``group`` to pass: for a work dir that user cannot reach.

    ``system_dir`` (default /var/lib/llmgw) is root's and 0711 when the agent
    makes it: anyone may pass, nobody may list it or write to it. One that
    exists is the operator's (``LLMGW_SYSTEM_DIR=/srv``): it is used as it is
    if root's alone (not a link, not writable by group or others), never
    changed. Below it all is 0710, root's with the engine group, as the work
    dir itself would be: the group passes to what it was given (its home,
    the weights cache, the engine cache) and lists nothing. A ``work-dir``
    file says which work dir a digest belongs to. Raises EngineUserError
    where a link could be planted: ``system_dir`` or a directory above it
    not root's alone (checked before anything is made).
    """
    _check_parents(system_dir)
    system_dir.parent.mkdir(parents=True, exist_ok=True)
    _owned_dir(system_dir, 0o711, None, keep_existing=True)
    base = system_base(system_dir, work_dir)
    place = base / "agent" / node
    for path in (base, base / "agent", place):
        _owned_dir(path, 0o710, group)
    # Two agents of one work dir may start together: the first note stands.
    with contextlib.suppress(FileExistsError):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(base / "work-dir", flags, 0o600), "w") as fh:
            fh.write(f"{work_dir.resolve()}\n")
    return place


def _check_parents(path: Path) -> None:
    """Refuse ``path`` when a directory above it that exists is another user's,
    or writable by others without the sticky bit: one could swap ``path``."""
    for parent in path.parents:
        try:
            st = parent.stat()
        except FileNotFoundError:
            continue  # made below, by the agent
        if st.st_uid not in (0, os.geteuid()) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        ):
            raise EngineUserError(f"{parent}, above {path}, is writable by others")


def _owned_dir(path: Path, mode: int, group: int | None, *, keep_existing: bool = False) -> None:
    """Make ``path`` a real directory (not a link) of root's with ``mode`` and ``group``.

    ``keep_existing``: one that exists already is not changed, only checked
    (root's, not writable by group or others); ``mode`` is for a new one.
    """
    created = True
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        created = False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise EngineUserError(f"{path} belongs to uid {st.st_uid}, not the agent's")
        if keep_existing and not created:
            if st.st_mode & 0o022:
                raise EngineUserError(
                    f"{path} is writable by {'group' if st.st_mode & 0o020 else 'others'}"
                    f" (mode {stat.S_IMODE(st.st_mode):o}): not changed, not used"
                )
            return
        os.fchown(fd, -1, group if group is not None else st.st_gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
