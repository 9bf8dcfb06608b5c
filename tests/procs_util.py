"""Counting processes the way an operator would: by scanning /proc."""

import os
from pathlib import Path


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
    found: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes() + b"\0"
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ:
            found.append(int(proc.name))
    return found
