"""LiteLLM's proxy for the router benchmark: installed in a throwaway venv and
started offline in front of the same mock engine."""

import os
import subprocess
import sys
from pathlib import Path

from tests.bench.fasthttp import MODEL
from tests.bench.procs import free_port, spawn, stop, wait_http

LITELLM_VENV = Path("/tmp/litellm-venv")


def ensure_litellm(venv: Path) -> tuple[Path | None, str]:
    """LiteLLM's proxy in a throwaway venv: its path, or why not."""
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe, ""
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        done = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"venv/pip failed: {exc}"
    if done.returncode != 0 or not exe.exists():
        return None, f"pip install 'litellm[proxy]' failed: {done.stderr.strip()[-500:]}"
    return exe, ""


def start_litellm(
    exe: Path, up_port: int, work: Path, log: Path
) -> tuple[subprocess.Popen[bytes] | None, int, str]:
    port = free_port()
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{up_port}/v1\n"
        "      api_key: none\n"
        "general_settings:\n"
        "  master_key: sk-bench-litellm\n"
    )
    # Offline: the bundled model cost map, no telemetry.
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    env["NO_PROXY"] = "*"
    proc = spawn(
        [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
         "--num_workers", "1"],
        env, log,
    )  # fmt: skip
    if wait_http(port, "/health/liveliness", lambda d: b" 200 " in d[:20], 180):
        return proc, port, ""
    stop(proc)
    return None, 0, f"did not start: {log.read_text(errors='replace')[-800:]}"
