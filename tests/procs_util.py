"""Counting processes the way an operator would: by scanning /proc."""

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from worker_agent.supervisor import ENGINE_MARKER, Supervisor


def pids_with_args(*needles: str) -> list[int]:
    """Live pids whose command line contains every needle."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and all(n in cmd for n in needles):
            found.append(int(entry.name))
    return found


def pids_with_env(entry: str) -> list[int]:
    """Live pids whose environment holds ``entry`` (e.g. ``LLMGW_WORK_DIR=/x``)."""
    needle = entry.encode() + b"\0"
    return _pids_whose_environ(lambda environ: needle in environ + b"\0")


def pids_with_env_prefix(prefix: str) -> list[int]:
    """Live pids with an environment entry starting with ``prefix`` (``NAME=/dir/``)."""
    needle = b"\0" + prefix.encode()
    return _pids_whose_environ(lambda environ: needle in b"\0" + environ)


def _pids_whose_environ(matches: Callable[[bytes], bool]) -> list[int]:
    """Live pids but this one's (no zombies) whose raw environment ``matches``."""
    found: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and matches(environ):
            found.append(int(proc.name))
    return found


def agent_places(work: Path) -> list[Path]:
    """Where the agents of ``work`` (or of any work dir under it) keep their shards.

    The work dir itself, and the place an agent running as root makes for a
    work dir its engine user cannot reach: ``<system dir>/<digest>/``, named
    by the ``work-dir`` note in it (worker_agent/system_dir.py ``system_place``).
    """
    work = work.resolve()
    places = [work]
    system_dir = Path(os.environ.get("LLMGW_SYSTEM_DIR", "/var/lib/llmgw"))
    for note in system_dir.glob("*/work-dir"):
        try:
            named = Path(note.read_text().strip())
        except OSError:
            continue
        if named == work or work in named.parents:
            places.append(note.parent)
    return places


def engine_pids(work: Path, *needles: str) -> list[int]:
    """Live processes of engines started by agents of ``work`` (by their engine
    marker, ``LLMGW_ENGINE_OF``) whose command line contains every needle."""
    marked: set[int] = set()
    for place in agent_places(work):
        marked.update(pids_with_env_prefix(f"{ENGINE_MARKER}={place}/"))
    return sorted(pid for pid in pids_with_args(*needles) if pid in marked)


@contextlib.contextmanager
def stopped_after(sup: Supervisor, grace_s: float = 0.5) -> Iterator[Supervisor]:
    """``sup``; afterwards every shard it recorded is stopped and its children reaped."""
    yield sup
    for ref in sup.recorded():
        sup.stop(ref, grace_s=grace_s)
    sup.reap()


def uids(pid: int) -> list[int]:
    """Real, effective, saved and filesystem uids of a live process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(v) for v in line.split()[1:]]
    raise AssertionError("no Uid line")
