"""Engines run as llmgw-engine, not root, with a 0700 home of their own."""

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from llmgw.engine_install import LlamaCppInstall
from llmgw.tinymodel import TinyModel
from llmgw.types import (
    LaunchShardInput,
    ModelSpec,
    ShardRef,
    ShardSpec,
    StopShardInput,
    WaitReadyInput,
)
from tests.harness import node_activities
from worker_agent.supervisor import Supervisor
from worker_agent.users import DEFAULT_ENGINE_USER, prepare_home, resolve_run_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")


@pytest.fixture
def open_work_dir() -> Iterator[Path]:
    """A work dir the engine user can reach (pytest's own tmp dirs are 0700)."""
    work = Path(tempfile.mkdtemp(prefix="llmgw-user-", dir="/tmp"))
    work.chmod(0o755)
    yield work
    shutil.rmtree(work, ignore_errors=True)


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def test_node_setup_creates_the_user_in_gpu_groups() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "node", "setup"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    entry = pwd.getpwnam(DEFAULT_ENGINE_USER)
    groups = subprocess.run(
        ["id", "-nG", DEFAULT_ENGINE_USER], capture_output=True, text=True, check=True
    )
    assert {"video", "render"} <= set(groups.stdout.split())
    assert entry.pw_uid != 0


async def test_engine_runs_as_engine_user(
    llama: LlamaCppInstall, tiny: TinyModel, open_work_dir: Path
) -> None:
    subprocess.run(
        [sys.executable, "-m", "llmgw", "node", "setup"], check=True, capture_output=True
    )
    model = open_work_dir / "tiny.gguf"
    shutil.copy(tiny.model_path, model)
    model.chmod(0o644)
    run_as, why = resolve_run_as(DEFAULT_ENGINE_USER, open_work_dir, [llama.server, model])
    assert run_as is not None, why
    prepare_home(run_as)
    acts = node_activities(llama, Supervisor(open_work_dir / "agent", "user-node", run_as))
    env = ActivityEnvironment()
    ref = ShardRef(replica_id="as-user")
    spec = ShardSpec(replica_id="as-user", model=ModelSpec(name="tiny-user", source=str(model)))
    handle = await env.run(acts.launch_shard, LaunchShardInput(spec=spec))
    try:
        await env.run(acts.wait_shard_ready, WaitReadyInput(shard=ref, timeout_s=60))
        assert _uid_of(handle.pid) == run_as.uid
        home = run_as.home.stat()
        assert home.st_uid == run_as.uid and (home.st_mode & 0o777) == 0o700
        environ = Path(f"/proc/{handle.pid}/environ").read_bytes().split(b"\0")
        assert f"HOME={run_as.home}".encode() in environ
        assert Path(f"/proc/{handle.pid}/cwd").resolve() == run_as.home
    finally:
        await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
        await acts.aclose()


def test_unreachable_work_dir_keeps_root_and_says_why(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "llmgw", "node", "setup"], check=True, capture_output=True
    )
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    run_as, why = resolve_run_as(DEFAULT_ENGINE_USER, hidden, [])
    assert run_as is None
    assert "cannot reach" in why


def test_missing_user_keeps_root_and_says_why(tmp_path: Path) -> None:
    run_as, why = resolve_run_as("no-such-llmgw-user", tmp_path, [])
    assert run_as is None
    assert "does not exist" in why and "llmgw node setup" in why
