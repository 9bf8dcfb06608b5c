"""The tests' own leftover-engine killer (tests/conftest.py ``EngineWatch``).

Engines of agents whose work dir is outside ``tmp_path`` (made with mkdtemp
where the engine user can pass) are killed once the fixture registers the
dir; an engine left in pytest's own process group is killed alone, never
with the group (which would take pytest down).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import EngineWatch
from worker_agent.supervisor import ENGINE_MARKER


@pytest.fixture
def outside() -> Iterator[Path]:
    place = Path(tempfile.mkdtemp(prefix="llmgw-watch-", dir="/tmp"))
    yield place
    shutil.rmtree(place, ignore_errors=True)


def _engine(place: Path, *, own_group: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, ENGINE_MARKER: f"{place}/agent/n/shards"}
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env=env, start_new_session=own_group,
    )  # fmt: skip


def test_a_registered_dir_outside_tmp_path_is_watched(tmp_path: Path, outside: Path) -> None:
    in_session = _engine(outside, own_group=True)
    in_pytest_group = _engine(outside, own_group=False)
    try:
        watch = EngineWatch([tmp_path])
        assert watch.kill_left() == []  # not watched: left alone
        assert in_session.poll() is None
        watch.watch(outside)
        killed = watch.kill_left()
        assert sorted(killed) == sorted([in_session.pid, in_pytest_group.pid])
        assert in_session.wait(timeout=10) == -9
        assert in_pytest_group.wait(timeout=10) == -9
        # Still here: pytest's own group was not signalled.
        assert os.getpgid(os.getpid()) == os.getpgrp()
    finally:
        for proc in (in_session, in_pytest_group):
            proc.kill()
            proc.wait()
