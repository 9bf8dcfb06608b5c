"""What the engines' user can reach, and copies made for it where it cannot.

Split from worker_agent/installs/llamacpp.py, whose :func:`relocated` (and
the portable server's launcher) use these: an interpreter every user may run,
where an installed package lives and its version, and a directory copied once
into an engine cache, staged beside its place and renamed into it whole under
a lock, its files readable by all (hard links where the original already is).
Nothing here knows llama.cpp.
"""

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from worker_agent.installs.steps import MARKER, Progress, locked


def package_dir(name: str) -> Path | None:
    """Where the package ``name`` is imported from here, if it is installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache  # asked on every inventory; the answer holds for the process
def engine_python() -> str:
    """An interpreter (>= 3.10, the wheel's ABI) that any user can run: this one's base
    when it and its standard library are world-reachable, else the system's."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    if world_reachable(base) and world_reachable(Path(sysconfig.get_paths()["stdlib"])):
        return str(base)
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(candidate)
        if path.exists() and world_reachable(path.resolve()):
            check = [candidate, "-c", "import sys; sys.exit(sys.version_info < (3, 10))"]
            if subprocess.run(check, capture_output=True, timeout=30, check=False).returncode == 0:
                return candidate
    return str(base)  # engines run as the agent's user, or the agent says who cannot reach it


def world_reachable(path: Path) -> bool:
    """Whether every user may traverse to ``path`` and read it (or enter it)."""
    try:
        for part in [*reversed(path.parents), path]:
            mode = part.stat().st_mode
            need = stat.S_IXOTH if part != path or stat.S_ISDIR(mode) else stat.S_IROTH
            if not mode & need:
                return False
    except OSError:
        return False
    return True


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def make_dirs(path: Path) -> None:
    """``path`` and its missing parents, each made 0755 whatever the umask: the
    engines' user passes through the engine cache to what it runs."""
    missing = [p for p in [*reversed(path.parents), path] if not p.exists()]
    for part in missing:
        with contextlib.suppress(FileExistsError):  # a concurrent installer made it
            part.mkdir(mode=0o755)
            part.chmod(0o755)


def place_copy(
    source: Path, home: Path, progress: Progress | None, *, inside: str = "", marked: bool = False
) -> None:
    """A copy of the directory ``source`` at ``home/inside``, made once: staged
    beside ``home`` under its lock and renamed into place whole. ``marked``: done
    only once ``home`` holds the completion marker (written last, unless the
    copy brings its own, as a build's does); else once ``home`` exists."""
    done = home / MARKER if marked else home
    if done.exists():
        return
    make_dirs(home.parent)
    with locked(home.parent / f"{home.name}.lock", progress):
        if done.exists():  # whoever held the lock before us copied it
            return
        for stale in home.parent.glob(f".{home.name}.work-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed copy; we hold the lock
        work = Path(tempfile.mkdtemp(prefix=f".{home.name}.work-", dir=home.parent))
        try:
            stage = work / home.name
            _copy_readable(source, stage / inside)
            stage.chmod(0o755)
            if marked and not (stage / MARKER).exists():
                (stage / MARKER).write_text(json.dumps({"copied_from": str(source)}) + "\n")
                (stage / MARKER).chmod(0o644)
            if home.exists():
                shutil.rmtree(home)  # an unmarked leftover; complete ones never get here
            os.replace(stage, home)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _copy_readable(source: Path, dest: Path) -> None:
    """``source``'s tree at ``dest``: directories 0755, files readable by all (and
    runnable by all where their owner may run them)."""
    dest.mkdir(mode=0o755, parents=True)
    dest.chmod(0o755)
    for entry in os.scandir(source):
        path, into = Path(entry.path), dest / entry.name
        if entry.is_dir():
            _copy_readable(path, into)
        elif entry.is_file():
            _link_or_copy(path, into)


def _link_or_copy(source: Path, dest: Path) -> None:
    st = source.stat()
    mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
    linkable = st.st_uid == os.geteuid() and st.st_mode & 0o7777 == mode
    if linkable:  # a link shares the original's owner and mode: only one that fits
        try:
            os.link(source, dest)
            return
        except OSError:  # another filesystem, or links not allowed there
            pass
    shutil.copyfile(source, dest)
    dest.chmod(mode)
