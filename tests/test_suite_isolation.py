"""The test suite does not depend on what ``make run`` left, nor leave engines
for the tests after it (issue 23: ``make test`` after ``make run`` failed 13)."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

from llmgw.settings import UpSettings
from tests.harness import REPO, engine_cache
from tests.procs_util import pids_with_args

FAILING_TEST = """
import os, sys
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import Supervisor
from llmgw.types import ShardRef

ENGINE = "import os, time\\nos.fork()\\nwhile True: time.sleep(1)"

def test_fails_with_its_engine_running(tmp_path):
    command = Command([sys.executable, "-c", ENGINE, "{tag}"], dict(os.environ))
    Supervisor(tmp_path).launch(ShardRef(replica_id="x"), [command], 1, "x", ShardRecord())
    assert False, "a test failing half-way"
"""


def test_the_engine_cache_is_not_make_runs() -> None:
    """``make run``'s agent makes its work dir (and so its engine cache) 0710
    for its own engine group: the tests' engine users could not reach it."""
    run_work = UpSettings().work_dir.resolve()
    assert run_work not in engine_cache().resolve().parents
    assert engine_cache().resolve() != UpSettings().resolved_engine_cache_dir()


def test_a_failed_test_leaves_no_engine(tmp_path: Path) -> None:
    tag = f"tag-left-{uuid.uuid4().hex[:8]}"
    test_file = tmp_path / "test_leaves_an_engine.py"
    test_file.write_text(FAILING_TEST.replace("{tag}", tag))
    try:
        # tests/conftest.py as a plugin: the file is outside tests/.
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        argv += ["-p", "tests.conftest", "--rootdir", str(REPO), str(test_file)]
        run = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False
        )
        assert run.returncode == 1 and "a test failing half-way" in run.stdout, run.stdout
        assert pids_with_args(tag) == [], "the engine and its worker outlived the test"
    finally:
        for pid in pids_with_args(tag):
            os.kill(pid, 9)
