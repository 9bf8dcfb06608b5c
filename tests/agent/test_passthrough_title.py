"""The pass-through names its replica in ps, and its /proc environ stays as started.

It runs as ``python -I -m worker_agent.passthrough``: an operator could not tell
which replica a pass-through served, nor which pass-through belonged to which
engine (issue 23 item 14). Its environment carries the engine marker the agent
and the CI leftover check read, so the title must not be written over it.
"""

import os
import subprocess
import sys
from pathlib import Path

import httpx

from llmgw_cli.procs import wait_for
from tests.harness import free_port, port_open
from worker_agent import passthrough
from worker_agent.supervisor import ENGINE_MARKER, TITLE_ENV


def test_the_title_variable_is_the_supervisors() -> None:
    assert passthrough.TITLE_ENV == TITLE_ENV


def test_the_pass_through_is_titled_with_its_replica_and_keeps_its_environment(
    tmp_path: Path,
) -> None:
    port, upstream = free_port(), f"http://127.0.0.1:{free_port()}"
    argv = passthrough.command(sys.executable, "127.0.0.1", port, upstream)
    label = "llmgw llama.cpp replica r-7 rank 0"
    env = {"PATH": "/usr/bin:/bin", ENGINE_MARKER: str(tmp_path), TITLE_ENV: label}
    log = tmp_path / "passthrough.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(passthrough.keys_input("replica-key", "engine-key"))
    proc.stdin.close()
    try:
        assert wait_for(lambda: port_open(port) or proc.poll() is not None, 60)
        assert proc.poll() is None, log.read_text()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert cmdline.startswith(f"worker_agent.passthrough [{label}] --listen 127.0.0.1:{port}")
        assert "replica-key" not in cmdline and "engine-key" not in cmdline
        ps = subprocess.run(
            ["ps", "-o", "args=", "-p", str(proc.pid)], capture_output=True, text=True, check=True
        ).stdout
        assert ps.startswith(f"worker_agent.passthrough [{label}]"), ps
        # The environment area as it was started: marker and title readable, nothing
        # written over them (and SPT_NOENV, set after the start, not in it).
        if os.geteuid() == 0:  # non-dumpable: its /proc files are root's
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
            assert environ == b"".join(f"{k}={v}\0".encode() for k, v in env.items())
        # Still the pass-through: no key, no entry.
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 401
    finally:
        proc.terminate()
        proc.wait(30)
