"""Reading processes from /proc: identities that survive pid reuse."""

import re
from pathlib import Path

PROC = Path("/proc")
# An environment entry: NAME=value, NAME as a shell variable name.
_ENV_ENTRY = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*=")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest


def same_process(pid: int, recorded: object, marker: str | None = None) -> bool:
    """Whether ``pid`` is still the live process a launch recorded.

    ``recorded`` is the launch's ``{"start_time": ..., ...}``; ``marker`` the
    ``NAME=value`` entry the launch put in its environment (None: records
    from before markers were kept).
    """
    start = start_time(pid)
    if start is None or is_zombie_or_gone(pid):
        return False
    return matches(recorded, start, environ_has(pid, marker) if marker else None)


def matches(recorded: object, current_start: int, has_marker: bool | None = None) -> bool:
    """Whether a live process is the one a launch recorded.

    Its pid and start time identify it: a pid is reused only after its
    process is gone, and the new one starts later. The command line is not
    compared: it is not the process's identity - a launcher script execs its
    interpreter (the portable llama-server is ``/bin/sh`` exec'ing
    ``python3``), an engine retitles itself, and a restarted agent then took
    a healthy engine for a stranger and killed it. ``has_marker``: whether
    its environment holds the launch's engine marker (None: not readable or
    not recorded, so not judged); a process without it is not the engine.
    """
    if not isinstance(recorded, dict) or current_start != recorded.get("start_time"):
        return False
    return has_marker is not False


def environ_has(pid: int, entry: str) -> bool | None:
    """Whether ``/proc/<pid>/environ`` holds ``entry`` (``NAME=value``).

    None where it cannot be told: not readable (another user's process to a
    non-root agent, or one made non-dumpable), empty (a process between exec
    and its new image being set up shows none yet), or holding no
    ``NAME=value`` entry at all: a process that retitled itself over its
    environment's memory (setproctitle without SPT_NOENV, as vLLM does) shows
    its title's tail and NULs there, which says nothing about the marker.
    """
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    entries = raw.split(b"\0")
    if not any(_ENV_ENTRY.match(e) for e in entries):
        return None
    return entry.encode() in entries


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
