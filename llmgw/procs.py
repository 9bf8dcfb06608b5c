"""Child processes of ``llmgw up`` (and of the tests): start, watch, stop.

Each child gets its own session, so a Ctrl-C in the terminal reaches only
``llmgw up``, which then stops everything in order; and each asks the kernel
to SIGTERM it if its parent dies, so a killed ``up`` leaves no orphans.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

_PR_SET_PDEATHSIG = 1
PredicateFn = Callable[[], bool]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Child:
    """One child process in its own process group, output to a log file."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Runs between fork and exec; safe here because it only
                # calls prctl, no locks or allocations of the parent's threads.
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )

    @property
    def pid(self) -> int:
        """The child's pid (also its process group id)."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the child still runs."""
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child's whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait, then SIGKILL it; returns the exit code."""
        if self.alive():
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        # The leader may be gone while a grandchild still holds the group.
        self.signal(signal.SIGKILL)
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 20) -> str:
        """The end of the child's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def wait_for(predicate: "PredicateFn", timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
