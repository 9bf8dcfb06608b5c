"""``llmgw up`` (what ``make run`` runs): serves a completion, and Ctrl-C
leaves no process behind, engines included."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai

from tests.harness import REPO, free_port
from tests.procs_util import pids_with_args, pids_with_env


def _read_until(
    proc: subprocess.Popen[str], marker: str, timeout: float
) -> tuple[str, threading.Thread]:
    """Collect stdout until a line contains ``marker`` (or the process ends)."""
    seen: list[str] = []
    found = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                found.set()
                return

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    found.wait(timeout)
    return "".join(seen), reader


def test_up_serves_a_completion_and_ctrl_c_cleans_up(tmp_path: Path) -> None:
    work = tmp_path / "work"
    router_port = free_port()
    env = dict(
        os.environ,
        LLMGW_WORK_DIR=str(work),
        LLMGW_ENGINE_CACHE_DIR=os.environ.get(
            "LLMGW_TEST_ENGINE_CACHE", str(REPO / ".llmgw" / "engines")
        ),
        LLMGW_PORT_RANGE_START=str(free_port()),
        # pytest's temp dirs are 0700: an engine user could not reach them
        # (as in tests/harness.py).
        LLMGW_ALLOW_ROOT_ENGINES="true",
    )
    stderr = open(tmp_path / "up.stderr", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw",
            "up",
            "--router-port",
            str(router_port),
            "--temporal-port",
            str(free_port()),
            "--ui-port",
            str(free_port()),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )
    reader: threading.Thread | None = None
    try:
        output, reader = _read_until(proc, "Ctrl-C stops everything", timeout=240)
        key = (work / "dev-api-key").read_text().strip()
        assert key in output, (tmp_path / "up.stderr").read_text()[-3000:]
        assert f"http://127.0.0.1:{router_port}/v1" in output
        oai = openai.OpenAI(
            base_url=f"http://127.0.0.1:{router_port}/v1", api_key=key, max_retries=0
        )
        resp = oai.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
        assert resp.usage is not None and resp.usage.completion_tokens == 4
        assert len(pids_with_args("--alias", "tiny", str(work))) == 1

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stderr.close()
        if reader is not None:
            reader.join(timeout=10)  # it ends at EOF, now the process is gone
        if proc.stdout is not None:
            proc.stdout.close()
    assert pids_with_env(f"LLMGW_WORK_DIR={work}") == []
    assert pids_with_args(str(work)) == []
