"""Engines get no controlling terminal, even from an agent run by hand in one.

The agent runs under a real pseudo-terminal (``pty.fork``), as ``llmgw
agent`` typed into a root shell does, and launches an engine-like child
through its supervisor; the child tries ``/dev/tty``. Without the agent
giving up its terminal at start (worker_agent/terminal.py), the child opens
it: an engine could read what root types there, or push input into it.
"""

import errno
import os
import pty
import select
import shlex
import sys
import time
from pathlib import Path

import pytest

AGENT = """
import os, sys, pathlib, time
from llmgw.types import ShardRef
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import Supervisor
from worker_agent.terminal import detach_terminal

PROBE = '''
import os
try:
    os.close(os.open("/dev/tty", os.O_RDWR))
    print("tty: opened", flush=True)
except OSError as e:
    print("tty: errno", e.errno, flush=True)
'''
work, how = pathlib.Path(sys.argv[1]), sys.argv[2]
if how != "session-leader":
    # A job-control shell makes each command a process-group leader, for which
    # setsid() fails.
    os.setpgid(0, 0)
print("agent has a terminal:", os.path.exists("/proc/self/fd/0") and os.isatty(0), flush=True)
if how != "keep":
    print("gave it up:", detach_terminal(), flush=True)
sup = Supervisor(work)
ref = ShardRef(replica_id="tty")
command = Command([sys.executable, "-c", PROBE], dict(os.environ))
sup.launch(ref, [command], 1, "x", ShardRecord())
log = sup.shard_dir(ref) / "engine.log"
deadline = time.monotonic() + 60
while b"tty:" not in (log.read_bytes() if log.exists() else b""):
    if time.monotonic() > deadline:
        break
    time.sleep(0.05)
sup.stop(ref, grace_s=0.5)
print("engine said:", log.read_text().strip(), flush=True)
"""


def _under_a_terminal(argv: list[str], timeout: float = 120) -> str:
    """Run ``argv`` with a new pseudo-terminal as its controlling terminal; its output."""
    pid, master = pty.fork()
    if pid == 0:  # the child: a session leader with the pty as its terminal
        try:
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1)
            if not ready:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal's last holder is gone
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        with_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(with_status[1]) == 0, out
    return out.decode(errors="replace").replace("\r\n", "\n")


def _agent_in_a_shell(tmp_path: Path, how: str) -> str:
    """The agent as a shell runs it: the shell leads the session (it is not
    exec'd over), the agent is a process of that session."""
    agent = [sys.executable, "-c", AGENT, str(tmp_path), how]
    command = " ".join(shlex.quote(a) for a in agent)
    if how == "session-leader":
        command = f"exec {command}"  # the agent leads the session itself
    else:
        command += "; true"
    repo = Path(__file__).parents[2]
    return _under_a_terminal(["/bin/sh", "-c", f"cd {shlex.quote(str(repo))} && {command}"])


def test_without_giving_it_up_an_engine_would_share_the_terminal(tmp_path: Path) -> None:
    """The control: there is a terminal to lose, and engines inherit it."""
    out = _agent_in_a_shell(tmp_path, "keep")
    assert "agent has a terminal: True" in out, out
    assert "engine said: tty: opened" in out, out


@pytest.mark.parametrize("how", ["group-leader", "session-leader"])
def test_an_engine_started_by_the_agent_has_no_terminal(tmp_path: Path, how: str) -> None:
    out = _agent_in_a_shell(tmp_path, how)
    assert "agent has a terminal: True" in out, out
    assert "gave it up: True" in out, out
    assert f"engine said: tty: errno {errno.ENXIO}" in out, out
