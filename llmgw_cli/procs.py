"""Child processes of ``llmgw up`` (and of the tests): start, watch, stop.

Each child gets its own session, so a Ctrl-C in the terminal reaches only
``llmgw up``, which then stops everything in order; and each asks the kernel
to SIGTERM it if its parent dies, so a killed ``up`` leaves no orphans.
A :class:`Supervised` child is started again when it dies, after a backoff.
"""

import contextlib
import ctypes
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_PR_SET_PDEATHSIG = 1
PredicateFn = Callable[[], bool]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Child:
    """One child process in its own process group, output to a log file.

    The log and its directory are private (0600 and 0700, whatever the
    umask): they sit in ``llmgw up``'s work dir, which the engine group may
    pass through, and hold what the processes print. ``umask``: the child's
    (None: ours), for one whose files should be private too.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: Mapping[str, str],
        log_path: Path,
        umask: int | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        private_log_dir(log_path.parent)
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # one made before by an older version
        with os.fdopen(fd, "ab") as log:
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
                umask=-1 if umask is None else umask,
            )

    @property
    def pid(self) -> int:
        """The child's pid (also its process group id)."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the child still runs."""
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        """How the child ended (``-N`` for signal N), or None while it runs."""
        return self.proc.poll()

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child's whole process group, while it is the child's."""
        signal_group(self.proc, sig)

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
        return log_tail(self.log_path, lines)


def signal_group(proc: "subprocess.Popen[bytes]", sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``proc`` leads, while it is ``proc``'s."""
    if proc.returncode is not None and os.path.exists(f"/proc/{proc.pid}"):
        # The child was reaped and its pid is another process's now: a
        # pid is not reused while any member of our group lives, so the
        # group is empty and that id may lead a stranger's group.
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def private_log_dir(path: Path) -> None:
    """Create ``path`` (and parents) and make it 0700: logs are nobody else's to list.

    Left as it is when it is not ours or is shared (sticky, as /tmp).
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX and st.st_mode & 0o777 != 0o700:
        path.chmod(0o700)


def log_tail(path: Path, lines: int = 20) -> str:
    """The end of a log file, for error messages ("" when there is none)."""
    try:
        text = path.read_text(errors="replace")
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


class Process(Protocol):
    """What :class:`Supervised` needs of a child (a :class:`Child`, or a fake)."""

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...

    def exit_code(self) -> int | None: ...

    def stop(self, grace_s: float = 10.0) -> int | None: ...


@dataclass(frozen=True)
class Backoff:
    """Delays before restarting a child that died: ``initial_s`` doubling up
    to ``max_s``; a child that had stayed up ``reset_after_s`` counts as
    healthy again and its next restart waits ``initial_s``."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait before restart number ``failures + 1`` in a row."""
        # The exponent is capped: 2**failures would overflow a float after
        # ~1,000 crashes, long after the delay has reached max_s anyway.
        return min(self.initial_s * 2.0 ** min(failures, 32), self.max_s)


Say = Callable[[str], None]


class Supervised:
    """A child that is started again when it dies, with :class:`Backoff`.

    Nothing here waits: :meth:`check`, called every fraction of a second,
    notices a death and schedules the restart, or restarts a child whose
    backoff is over; the clock and the start function are injected, so the
    decisions are tested without processes.
    """

    def __init__(
        self,
        name: str,
        start: Callable[[], Process],
        say: Say,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._start = start
        self._say = say
        self._backoff = backoff
        self._clock = clock
        self.child: Process | None = start()
        self._started_at = clock()
        self._failures = 0
        self.restart_at: float | None = None
        self.restarts = 0
        self._stopping = False

    def alive(self) -> bool:
        """Whether the child runs right now (False while in backoff)."""
        return self.child is not None and self.child.alive()

    def check(self) -> None:
        """Notice a death, or restart a child whose backoff is over."""
        if self._stopping:
            return
        now = self._clock()
        if self.child is not None and not self.child.alive():
            code = self.child.exit_code()
            self.child = None
            self._schedule(now, f"{self.name} exited with code {code}")
        if self.child is None and self.restart_at is not None and now >= self.restart_at:
            self.restart_at = None
            try:
                self.child = self._start()
            except OSError as exc:
                self._started_at = now
                self._schedule(now, f"{self.name} could not be started again: {exc}")
                return
            self._started_at = now
            self.restarts += 1
            self._say(f"{self.name} restarted (pid {self.child.pid})")

    def _schedule(self, now: float, what: str) -> None:
        if now - self._started_at >= self._backoff.reset_after_s:
            self._failures = 0
        delay = self._backoff.delay(self._failures)
        self._failures += 1
        self.restart_at = now + delay
        self._say(f"{what}; restarting in {delay:g} s")

    def hold(self) -> None:
        """Restart nothing from now on, not even a child in backoff."""
        self._stopping = True
        self.restart_at = None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stop the child for good (see :meth:`Child.stop`); no restart after."""
        self.hold()
        if self.child is None:
            return None
        return self.child.stop(grace_s)
