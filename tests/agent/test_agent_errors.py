"""Errors the agent's launch helpers raise are in the hierarchy (llmgw/errors.py).

``launch_shard`` turns an ``LlmgwError`` into the launch's failure; anything
else (a ValueError, an OSError, SystemExit) escaped it as an unexplained crash.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.errors import EngineLaunchError, InstanceRunningError, LlmgwError
from llmgw_cli.up import instance_lock
from worker_agent import spawn
from worker_agent.passthrough import keys_input


def test_a_bad_key_is_a_launch_error() -> None:
    with pytest.raises(EngineLaunchError):
        keys_input("two words", "x")
    with pytest.raises(EngineLaunchError):
        keys_input("k", "")


def test_a_secret_too_big_for_a_pipe_is_a_launch_error() -> None:
    with pytest.raises(EngineLaunchError), spawn._secret_pipe(b"k" * 100_000):
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to root needs root")
def test_still_root_after_the_drop_is_an_engine_user_error() -> None:
    """A drop that leaves root (here: to uid 0) raises EngineUserError, not
    SystemExit (which no except LlmgwError sees). In a child: it changes groups."""
    script = (
        "from llmgw.errors import EngineUserError\n"
        "from worker_agent.privileges import drop_privileges\n"
        "try:\n"
        "    drop_privileges('0:0::')\n"
        "except EngineUserError as e:\n"
        "    print('refused:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=60, check=True,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.stdout.startswith(b"refused: still root after dropping to 0:0::"), done


def test_a_second_instance_is_refused_with_its_own_error(tmp_path: Path) -> None:
    taken = pytest.raises(InstanceRunningError, match="another llmgw up is running")
    with instance_lock(tmp_path), taken, instance_lock(tmp_path):
        pass
    assert issubclass(InstanceRunningError, LlmgwError)
    assert not InstanceRunningError.retryable
