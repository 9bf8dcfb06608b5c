"""``llmgw up``'s restart decisions (llmgw_cli/procs.py): the backoff as pure
decisions over a fake clock and fake children, then one real child killed
and started again; and the shutdown watchdog (llmgw/lifecycle.py) ending a
real process whose shutdown hangs; private logs and one ``llmgw up`` per
work dir."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llmgw.errors import LlmgwError
from llmgw.lifecycle import WATCHDOG_EXIT
from llmgw_cli.procs import Backoff, Child, Supervised, wait_for
from llmgw_cli.up import instance_lock


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeChild:
    """A child that runs until the test says it died."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.code: int | None = None
        self.stopped_with: float | None = None

    def alive(self) -> bool:
        return self.code is None

    def exit_code(self) -> int | None:
        return self.code

    def stop(self, grace_s: float = 10.0) -> int | None:
        self.stopped_with = grace_s
        self.code = -15
        return self.code


class Harness:
    def __init__(self, backoff: Backoff | None = None) -> None:
        self.clock = FakeClock()
        self.said: list[str] = []
        self.started: list[FakeChild] = []
        self.fail_start: OSError | None = None
        self.sup = Supervised(
            "agent", self.start, self.said.append, backoff or Backoff(), self.clock
        )

    def start(self) -> FakeChild:
        if self.fail_start is not None:
            raise self.fail_start
        child = FakeChild(100 + len(self.started))
        self.started.append(child)
        return child

    def crash(self, code: int = -9) -> None:
        self.started[-1].code = code

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.sup.check()


def test_backoff_doubles_to_its_cap() -> None:
    backoff = Backoff(initial_s=1, max_s=30)
    assert [backoff.delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.delay(10_000) == 30


def test_a_dead_child_is_restarted_after_the_backoff_and_said_so() -> None:
    h = Harness()
    h.advance(5)
    h.crash(-9)
    h.advance(0.1)
    assert h.said == ["agent exited with code -9; restarting in 1 s"]
    assert len(h.started) == 1 and not h.sup.alive()
    h.advance(0.5)
    assert len(h.started) == 1  # still in backoff
    h.advance(0.5)
    assert len(h.started) == 2 and h.sup.alive()
    assert h.said[-1] == "agent restarted (pid 101)"
    assert h.sup.restarts == 1


def test_a_crash_loop_backs_off_exponentially_up_to_the_cap() -> None:
    h = Harness(Backoff(initial_s=1, max_s=8, reset_after_s=60))
    delays: list[float] = []
    for _ in range(6):
        h.crash(1)
        h.advance(0.01)
        assert h.sup.restart_at is not None
        delays.append(round(h.sup.restart_at - h.clock.now, 2))
        h.advance(delays[-1])
        assert h.sup.alive()
    assert delays == [1, 2, 4, 8, 8, 8]
    assert len(h.started) == 7


def test_a_child_that_stayed_up_starts_again_from_the_first_delay() -> None:
    h = Harness(Backoff(initial_s=1, max_s=30, reset_after_s=60))
    for _ in range(3):  # three quick crashes: the next wait would be 8 s
        h.crash()
        h.advance(0.01)
        h.advance(h.sup.restart_at - h.clock.now if h.sup.restart_at else 0)
    h.advance(61)  # then a minute up
    h.crash()
    h.advance(0.01)
    assert h.said[-1] == "agent exited with code -9; restarting in 1 s"


def test_a_child_in_backoff_is_not_restarted_once_stopping() -> None:
    h = Harness()
    h.crash()
    h.advance(0.1)
    h.sup.stop(grace_s=3)
    h.advance(60)
    assert len(h.started) == 1
    assert not any("restarted" in line for line in h.said)


def test_stop_stops_the_running_child_and_restarts_nothing_after() -> None:
    h = Harness()
    h.sup.stop(grace_s=2.5)
    assert h.started[0].stopped_with == 2.5
    h.advance(60)
    assert len(h.started) == 1 and h.said == []


def test_a_start_that_fails_is_tried_again_later() -> None:
    h = Harness()
    h.crash()
    h.advance(0.1)
    h.fail_start = OSError("no such file")
    h.advance(1)
    assert h.said[-1] == "agent could not be started again: no such file; restarting in 2 s"
    h.fail_start = None
    h.advance(2)
    assert h.sup.alive() and h.said[-1] == "agent restarted (pid 101)"


def test_a_real_child_killed_is_started_again(tmp_path: Path) -> None:
    said: list[str] = []

    def start() -> Child:
        return Child("sleeper", ["sleep", "600"], {}, tmp_path / "sleeper.log")

    sup = Supervised("sleeper", start, said.append, Backoff(initial_s=0.2))
    try:
        first = sup.child
        assert first is not None
        first_pid = first.pid
        os.kill(first_pid, signal.SIGKILL)

        def restarted() -> bool:
            sup.check()
            return sup.restarts == 1

        assert wait_for(restarted, 10), said
        assert said[0] == "sleeper exited with code -9; restarting in 0.2 s"
        assert sup.child is not None and sup.child.pid != first_pid and sup.alive()
    finally:
        sup.stop(grace_s=5)
    assert not sup.alive()


def test_the_watchdog_ends_a_shutdown_that_hangs(tmp_path: Path) -> None:
    # A process whose shutdown never finishes: after the signal it waits on
    # a thread stuck forever (as on a frozen database).
    script = textwrap.dedent(
        """
        import asyncio, threading, time
        from llmgw.lifecycle import stop_event_on_signals

        async def main():
            stop = stop_event_on_signals(1.5)
            print("ready", flush=True)
            await stop.wait()
            await asyncio.to_thread(threading.Event().wait)

        asyncio.run(main())
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == WATCHDOG_EXIT
    assert 1.4 < took < 10
    assert "shutdown did not finish within 1.5 s" in err


def test_a_childs_log_is_private_whatever_the_umask(tmp_path: Path) -> None:
    """``llmgw up``'s logs sit in a work dir the engine group may pass through."""
    (tmp_path / "logs").mkdir(mode=0o755)
    (tmp_path / "logs" / "old.log").write_text("from an older version\n")
    (tmp_path / "logs" / "old.log").chmod(0o644)
    old = os.umask(0o022)
    try:
        for name in ("new", "old"):
            Child(name, ["true"], {}, tmp_path / "logs" / f"{name}.log").proc.wait(timeout=10)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700
    for name in ("new", "old"):
        assert stat.S_IMODE((tmp_path / "logs" / f"{name}.log").stat().st_mode) == 0o600


HOLD_LOCK = """
import sys, time
from pathlib import Path
from llmgw_cli.up import instance_lock
with instance_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_one_up_per_work_dir_until_its_holder_dies(tmp_path: Path) -> None:
    """However the first ``llmgw up`` ends (SIGKILL here), the next may start."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            taken = rf"another llmgw up .* \(pid {holder.pid}\)"
            with pytest.raises(LlmgwError, match=taken), instance_lock(tmp_path):
                pass
        finally:
            holder.kill()
    assert stat.S_IMODE((tmp_path / "up.lock").stat().st_mode) == 0o600
    with instance_lock(tmp_path):
        assert (tmp_path / "up.lock").read_text() == f"{os.getpid()}\n"
