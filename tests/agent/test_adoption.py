"""A restarting agent adopts what it can identify and nothing else (stand-in
engines, and the real llama.cpp on each install path)."""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from llmgw.types import EngineKind, LaunchShardInput, ModelSpec, ShardRef, ShardSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import wait_for
from tests.conftest import LlamaPath
from tests.harness import node_activities
from tests.procs_util import pids_with_args, stopped_after
from worker_agent import procfs
from worker_agent.adoption import adopt
from worker_agent.main import stop_orphans
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import ENGINE_MARKER, Supervisor, engine_title

ENGINE = """
import os, sys, time
if os.fork() == 0:
    while True: time.sleep(1)
while True: time.sleep(1)
"""


def _launch(sup: Supervisor, replica: str, tag: str) -> int:
    command = Command([sys.executable, "-c", ENGINE, tag], dict(os.environ))
    running = sup.launch(
        ShardRef(replica_id=replica), [command], 1, "http://127.0.0.1:1", ShardRecord()
    )
    assert wait_for(lambda: len(pids_with_args(tag)) == 2, 10)
    return running.pid


@pytest.fixture
def first(tmp_path: Path) -> Iterator[Supervisor]:
    """The agent that started the engines; kept so its Popen objects reap them."""
    with stopped_after(Supervisor(tmp_path, "n1")) as sup:
        yield sup


def test_restarted_agent_adopts_the_same_pids(first: Supervisor, tmp_path: Path) -> None:
    pid_a = _launch(first, "ra", "tag-adopt-a")
    pid_b = _launch(first, "rb", "tag-adopt-b")
    second = Supervisor(tmp_path, "n1")
    report = adopt(second)
    assert sorted(r.pid for r in report.adopted) == sorted([pid_a, pid_b])
    assert report.lost == [] and report.killed == []
    log_text = (second.shard_dir(ShardRef(replica_id="ra")) / "engine.log").read_text()
    assert "adopted by agent" in log_text
    # The adopted engine is stopped by signalling its group: workers included.
    assert second.stop(ShardRef(replica_id="ra"), grace_s=1).was_running
    assert pids_with_args("tag-adopt-a") == []
    assert len(pids_with_args("tag-adopt-b")) == 2


def test_reused_pid_is_left_alone_and_the_shard_lost(first: Supervisor, tmp_path: Path) -> None:
    _launch(first, "rr", "tag-reused")
    spec = first.shard_dir(ShardRef(replica_id="rr")) / "spec.json"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Rewrite the spec as if the engine died and its pid went to a stranger.
        data = json.loads(spec.read_text())
        real = data["pid"]
        data["pid"] = stranger.pid
        spec.write_text(json.dumps(data))
        report = adopt(Supervisor(tmp_path, "n1"))
        assert report.adopted == [] and report.lost == [ShardRef(replica_id="rr")]
        assert procfs.start_time(stranger.pid) is not None, "the stranger must survive"
        # The real engine now has no spec: it is an unidentified engine, killed.
        assert report.killed == [real]
        assert wait_for(lambda: pids_with_args("tag-reused") == [], 5)
    finally:
        stranger.kill()
        stranger.wait()


def test_marked_engine_without_spec_is_killed(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, "n1")
    env = dict(os.environ, **{ENGINE_MARKER: sup.marker})
    rogue = subprocess.Popen(
        [sys.executable, "-c", ENGINE, "tag-rogue"], env=env, start_new_session=True
    )
    other_env = dict(os.environ, **{ENGINE_MARKER: "/another/agent/shards"})
    neighbour = subprocess.Popen(
        [sys.executable, "-c", ENGINE, "tag-neighbour"], env=other_env, start_new_session=True
    )
    try:
        assert wait_for(lambda: len(pids_with_args("tag-rogue")) == 2, 10)
        report = adopt(sup)
        assert report.killed == [rogue.pid]
        rogue.wait(timeout=5)
        assert wait_for(lambda: pids_with_args("tag-rogue") == [], 5)
        # Another agent's engine on the same host is not ours to kill.
        assert len(pids_with_args("tag-neighbour")) == 2
    finally:
        for proc in (rogue, neighbour):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for tag in ("tag-rogue", "tag-neighbour"):
            for pid in pids_with_args(tag):
                os.kill(pid, signal.SIGKILL)


async def test_engine_of_an_unknown_replica_is_stopped(first: Supervisor, client: Client) -> None:
    """The control plane has no workflow for this replica: nothing will ever
    route to its engine, which only holds resources, so the agent stops it."""
    _launch(first, "ghost-replica", "tag-ghost")
    stopped = await stop_orphans(client, first, grace_s=1)
    assert stopped == ["ghost-replica"]
    assert pids_with_args("tag-ghost") == []


async def test_a_real_engine_is_adopted_on_each_install_path(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    """The portable llama-server is python3 exec'd by a /bin/sh launcher: its
    command line is not the one launched, and a restarted agent once called it
    "gone or pid reused" and then killed it as an engine with no spec file."""
    model = ModelSpec(name="tiny-adopted", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    first = Supervisor(tmp_path, "n1")
    acts = node_activities(llama_path.install, first)
    try:
        spec = ShardSpec(replica_id="real-1", model=model)
        handle = await ActivityEnvironment().run(acts.launch_shard, LaunchShardInput(spec=spec))
        # Past the launcher's exec: what a restarted agent finds.
        assert wait_for(lambda: llama_path.runs(handle.pid), 30), llama_path
        # Titled for ps, whichever install (issue 23 item 14).
        cmdline = Path(f"/proc/{handle.pid}/cmdline").read_bytes().replace(b"\0", b" ")
        title = engine_title(ShardRef(replica_id="real-1"), "llama.cpp")
        assert cmdline.startswith(f"llama-server [{title}] ".encode()), cmdline
        assert b"--alias tiny-adopted" in cmdline
        group = os.getpgid(handle.pid)
        members = sorted(procfs.group_members(group))

        report = adopt(Supervisor(tmp_path, "n1"))
        assert [r.pid for r in report.adopted] == [handle.pid]
        assert report.lost == [] and report.killed == []
        assert sorted(procfs.group_members(group)) == members, "nothing killed"
    finally:
        first.stop(ShardRef(replica_id="real-1"), grace_s=5)
        await acts.aclose()
    assert procfs.group_members(group) == []
