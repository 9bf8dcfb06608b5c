""".ci/leftovers, the check CI runs after ``make test``, finds every process
an agent starts, whatever its command line: the portable llama-server showed
as ``python3 -s -c ...`` and a test's leftover engines went unnoticed."""

import os
import subprocess
import sys
from pathlib import Path

from llmgw.types import ShardRef
from llmgw_cli.procs import wait_for
from tests.harness import REPO
from tests.procs_util import pids_with_args
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import Supervisor

# An engine with nothing llmgw-like in its command line, and a worker it forks.
ANONYMOUS = "import os, time\nos.fork()\nwhile True: time.sleep(1)"


def leftovers() -> set[int]:
    run = subprocess.run(
        [str(REPO / ".ci" / "leftovers")], capture_output=True, text=True, timeout=60, check=True
    )
    assert run.stderr == "", run.stderr
    return {int(line) for line in run.stdout.split()}


def test_every_process_of_a_shard_is_found_whatever_its_command_line(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="anon")
    command = Command([sys.executable, "-c", ANONYMOUS, "tag-anon"], dict(os.environ))
    sup.launch(ref, [command], 1, "x", ShardRecord())
    try:
        assert wait_for(lambda: len(pids_with_args("tag-anon")) == 2, 10)
        assert set(pids_with_args("tag-anon")) <= leftovers()
    finally:
        sup.stop(ref, grace_s=0.5)
    assert not set(pids_with_args("tag-anon")) & leftovers()
