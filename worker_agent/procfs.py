"""Reading processes from /proc: fingerprints that survive pid reuse."""

from dataclasses import dataclass
from pathlib import Path

from worker_agent.engines.spec import redacted

PROC = Path("/proc")


@dataclass(frozen=True)
class Fingerprint:
    """What identifies a process beyond its pid: a reused pid differs in both."""

    start_time: int
    cmdline: tuple[str, ...]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest


def fingerprint(pid: int) -> Fingerprint | None:
    """The fingerprint of a live process, or None if there is none."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        raw_cmd = (PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    cmdline = tuple(part.decode(errors="replace") for part in raw_cmd.split(b"\0") if part)
    # Field 22 of stat is starttime; rest[] starts at field 3.
    return Fingerprint(start_time=int(fields[19]), cmdline=cmdline)


def same_process(pid: int, recorded: object) -> bool:
    """Whether ``pid`` is still the live process a launch recorded.

    ``recorded`` is the launch's ``{"start_time": ..., "cmdline": [...]}``. A
    reused pid differs in start time. The command line is compared too, except
    while it reads empty: between exec's point of no return and the new
    image's argument area being set up, /proc shows no command line at all
    (seen in 2 of 300 launches), and the start time alone still identifies it.
    """
    current = fingerprint(pid)
    return current is not None and not is_zombie_or_gone(pid) and matches(recorded, current)


def matches(recorded: object, current: Fingerprint) -> bool:
    """Whether a live process's fingerprint is the one a launch recorded."""
    if not isinstance(recorded, dict) or current.start_time != recorded.get("start_time"):
        return False
    if not current.cmdline:
        return True
    cmdline = recorded.get("cmdline")
    # Launches record the command line with secrets redacted (older ones in clear).
    return cmdline in (list(current.cmdline), redacted(current.cmdline))


def is_zombie_or_gone(pid: int) -> bool:
    """True when the process has exited (a zombie holds no resources but its pid)."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X")


def start_time(pid: int) -> int | None:
    """When a live process started (clock ticks after boot), or None if there is none."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def group_reused(pgid: int, leader_start: int | None) -> bool:
    """Whether group id ``pgid`` now belongs to someone else.

    A pid is not reused while any process holds it as its group id, so while
    any member of a recorded group lives, no process but the recorded leader
    can have the group's id as its pid. A live process with that pid and
    another start time therefore means the group emptied and the number went
    to a stranger, which may lead a group of that id itself (anything started
    in a new session does): signalling the recorded group would hit it. Pids
    wrap at 32768 on many machines, so this happens. ``leader_start`` None
    (a record from before leaders were recorded): not judged, False.
    """
    if leader_start is None:
        return False
    now = start_time(pgid)
    return now is not None and now != leader_start


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids in a process group."""
    members: list[int] = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # rest[0] is state, rest[2] is pgrp.
        if fields and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members
