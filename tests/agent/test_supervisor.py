"""The supervisor with stand-in engines: process groups, fingerprints, stop."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.types import ShardRef
from llmgw_cli.procs import wait_for
from tests.procs_util import pids_with_args
from worker_agent import procfs
from worker_agent.shard_record import ShardRecord, SpecFile
from worker_agent.spawn import Command
from worker_agent.supervisor import ENGINE_MARKER, TITLE_ENV, Supervisor, engine_title

# A stand-in engine that forks a worker, as vLLM and SGLang do, and ignores
# SIGTERM in the worker so only a group SIGKILL removes it.
FORKING_ENGINE = """
import os, signal, sys, time
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True: time.sleep(1)
print("leader up", flush=True)
while True: time.sleep(1)
"""


def _launch(sup: Supervisor, ref: ShardRef, tag: str) -> int:
    command = Command([sys.executable, "-c", FORKING_ENGINE, tag], dict(os.environ))
    running = sup.launch(ref, [command], 1, "http://x:1", ShardRecord())
    return running.pid


def test_stop_kills_the_whole_group(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="grp")
    _launch(sup, ref, "tag-grp")
    assert wait_for(lambda: len(pids_with_args("tag-grp")) == 2, 10)
    outcome = sup.stop(ref, grace_s=0.5)
    assert outcome.was_running
    assert pids_with_args("tag-grp") == []
    assert sup.stop(ref, grace_s=0.5).was_running is False


def test_found_again_by_a_new_supervisor(tmp_path: Path) -> None:
    ref = ShardRef(replica_id="adopt", rank=1)
    first = Supervisor(tmp_path)  # kept: its Popen must outlive the process
    pid = _launch(first, ref, "tag-adopt")
    again = Supervisor(tmp_path)
    try:
        found = again.find_running(ref)
        assert found is not None and found.pid == pid
    finally:
        again.stop(ref, grace_s=0.5)
    assert pids_with_args("tag-adopt") == []
    assert first.exit_code(ref) is not None  # the original parent reaps it


def test_reused_pid_is_not_adopted(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="reuse")
    _launch(sup, ref, "tag-reuse")
    spec = sup.shard_dir(ref) / "spec.json"
    # Point the spec at another live process (this test): same pid space, other start time.
    data = json.loads(spec.read_text())
    real_pid = data["pid"]
    data["pid"] = os.getpid()
    spec.write_text(json.dumps(data))
    assert sup.find_running(ref) is None
    data["pid"] = real_pid
    spec.write_text(json.dumps(data))
    assert sup.find_running(ref) is not None
    sup.stop(ref, grace_s=0.5)


def test_start_time_of_a_live_process_and_none_for_a_gone_one() -> None:
    start = procfs.start_time(os.getpid())
    assert start is not None and start > 0
    assert procfs.start_time(2**22 + 7) is None


def test_log_is_trimmed_keeping_the_newest_part(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="chatty")
    log_path = sup.shard_dir(ref) / "engine.log"
    log_path.parent.mkdir(parents=True)
    log_path.write_bytes(b"old\n" * 600_000 + b"newest line\n")
    assert sup.trim_log(ref, max_bytes=1_000_000)
    assert log_path.stat().st_size < 1000
    assert (log_path.parent / "engine.log.1").read_bytes().endswith(b"newest line\n")
    assert not sup.trim_log(ref, max_bytes=1_000_000)
    assert sup.log_tail(ref, 1) == ["--- log trimmed; the previous 1 MiB is in engine.log.1 ---"]


def test_sidecar_and_engine_share_one_group(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="sidecar")
    waited: list[int] = []
    sidecar = Command([sys.executable, "-c", FORKING_ENGINE, "tag-sidecar"], dict(os.environ))
    engine = Command([sys.executable, "-c", FORKING_ENGINE, "tag-main"], dict(os.environ))
    running = sup.launch(
        ref, [sidecar, engine], 1, "http://x:1", ShardRecord(), before_each=waited.append
    )
    assert waited == [0, 1]
    assert wait_for(lambda: len(pids_with_args("tag-sidecar")) == 2, 10)
    assert running.group != running.pid  # the sidecar leads the group
    assert sup.stop(ref, grace_s=0.5).was_running
    assert pids_with_args("tag-sidecar") == [] and pids_with_args("tag-main") == []


def test_failed_wait_kills_what_already_started(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    sidecar = Command([sys.executable, "-c", FORKING_ENGINE, "tag-orphan"], dict(os.environ))
    engine = Command([sys.executable, "-c", FORKING_ENGINE, "tag-never"], dict(os.environ))

    def rendezvous_never_listens(i: int) -> None:
        if i == 1:
            raise TimeoutError("head port never opened")

    with pytest.raises(TimeoutError):
        sup.launch(
            ShardRef(replica_id="x"),
            [sidecar, engine],
            1,
            "h",
            ShardRecord(),
            rendezvous_never_listens,
        )
    assert wait_for(lambda: pids_with_args("tag-orphan") == [], 5)
    assert pids_with_args("tag-never") == []


def test_identity_is_pid_start_time_and_marker_not_the_command_line() -> None:
    recorded = {"start_time": 42, "cmdline": ["llama-server", "-m", "x"]}
    assert procfs.matches(recorded, 42)
    assert not procfs.matches(recorded, 43)  # a reused pid starts later
    assert not procfs.matches(recorded, 42, has_marker=False)  # not an engine of ours
    assert procfs.matches(recorded, 42, has_marker=True)
    assert not procfs.matches(None, 42)


def test_an_engine_whose_launcher_execs_another_program_is_found_by_a_new_supervisor(
    tmp_path: Path,
) -> None:
    """The portable llama-server is a /bin/sh script exec'ing python3: /proc then
    shows a command line other than the one launched. A restarted agent took
    such a healthy engine for a stranger ("engine gone or pid reused"), then
    killed it as unidentified."""
    launcher = tmp_path / "llama-server"
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} -c "$ENGINE" "$@"\n')
    launcher.chmod(0o755)
    first = Supervisor(tmp_path)
    ref = ShardRef(replica_id="exec")
    env = dict(os.environ, ENGINE=FORKING_ENGINE)
    pid = first.launch(ref, [Command([str(launcher), "tag-exec"], env)], 1, "x", ShardRecord()).pid
    try:
        assert wait_for(lambda: len(pids_with_args(sys.executable, "tag-exec")) == 2, 10)
        again = Supervisor(tmp_path)
        found = again.find_running(ref)
        assert found is not None and found.pid == pid
    finally:
        first.stop(ref, grace_s=0.5)
    assert pids_with_args("tag-exec") == []


def test_a_process_without_the_recorded_marker_is_not_the_engine(tmp_path: Path) -> None:
    """Where the environment is readable, the engine marker must be in it: a
    process with the recorded pid and start time but without it is not ours."""
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="marked")
    _launch(sup, ref, "tag-marked")
    spec_path = sup.shard_dir(ref) / "spec.json"
    try:
        recorded = SpecFile.load(spec_path)
        assert recorded is not None and recorded.fingerprint is not None
        assert recorded.fingerprint.marker == sup.marker
        assert Supervisor(tmp_path).find_running(ref) is not None
        forged = recorded.fingerprint.model_copy(update={"marker": "/another/agent/shards"})
        spec_path.write_text(recorded.model_copy(update={"fingerprint": forged}).model_dump_json())
        assert Supervisor(tmp_path).find_running(ref) is None
        # The launching supervisor knows its own unreaped child without /proc.
        assert sup.find_running(ref) is not None
    finally:
        sup.stop(ref, grace_s=0.5)
    assert pids_with_args("tag-marked") == []


# A stand-in for vLLM: setproctitle without SPT_NOENV writes the title over
# the memory /proc/<pid>/environ shows, marker included.
RETITLING_ENGINE = """
import os, sys, time
os.environ.pop("SPT_NOENV", None)
import setproctitle
setproctitle.setproctitle("VLLM::EngineCore")
print("retitled", flush=True)
while True: time.sleep(1)
"""


def test_an_engine_that_retitled_itself_over_its_environment_is_adopted(
    tmp_path: Path,
) -> None:
    """Its environ then holds no NAME=value entry at all: that says nothing of
    the marker (unreadable, not absent), so pid and start time decide. The old
    reading took it for "marker absent" and a restarted agent killed a healthy
    vLLM."""
    first = Supervisor(tmp_path)
    ref = ShardRef(replica_id="retitled")
    command = Command([sys.executable, "-c", RETITLING_ENGINE, "tag-retitled"], dict(os.environ))
    pid = first.launch(ref, [command], 1, "x", ShardRecord()).pid
    log = first.shard_dir(ref) / "engine.log"
    try:
        assert wait_for(lambda: log.exists() and b"retitled" in log.read_bytes(), 30)
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert environ and f"{ENGINE_MARKER}=".encode() not in environ
        assert procfs.environ_has(pid, f"{ENGINE_MARKER}={first.marker}") is None
        found = Supervisor(tmp_path).find_running(ref)
        assert found is not None and found.pid == pid
    finally:
        first.stop(ref, grace_s=0.5)
    assert pids_with_args("tag-retitled") == []
    assert procfs.environ_has(os.getpid(), f"PATH={os.environ['PATH']}") is True
    assert procfs.environ_has(os.getpid(), f"{ENGINE_MARKER}=/elsewhere") is False


def _old_spec_file(pid: int, start_time: int, cmdline: list[str]) -> dict[str, object]:
    """A spec.json as agents wrote it before ShardRecord (a plain dict, json.dumps)."""
    return {
        "shard": {"replica_id": "old", "rank": 0},
        "pid": pid,
        "pgid": pid,
        "port": 8123,
        "endpoint": "http://127.0.0.1:8123",
        "fingerprint": {"start_time": start_time, "cmdline": cmdline},
        "spec": {
            "model": "tiny",
            "engine": "vllm",
            "gpu_indices": [0, 1],
            "priority": 5,
            "catalog_digest": "abc123",
            "serves_http": False,
            "ready_probe": {
                "health_path": "/health",
                "models_path": "/v1/models",
                "completion": {"path": "/v1/completions", "prompt": "Hi", "max_tokens": 1},
            },
            "plan": {"commands": [{"name": "engine", "argv": ["vllm", "serve"]}], "env": {}},
            "internal_port": 8124,
            "cpu_bind": "0-3",
        },
    }


def test_spec_files_written_before_shard_record_still_load(tmp_path: Path) -> None:
    """A restarted (upgraded) agent adopts engines recorded by the previous one."""
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        cmdline_file = Path(f"/proc/{stranger.pid}/cmdline")
        assert wait_for(lambda: b"time.sleep" in cmdline_file.read_bytes(), 5)
        cmdline = cmdline_file.read_bytes().decode().split("\0")[:-1]
        started = procfs.start_time(stranger.pid)
        assert started is not None
        old = _old_spec_file(stranger.pid, started, cmdline)
        sup = Supervisor(tmp_path)
        ref = ShardRef(replica_id="old")
        sup.shard_dir(ref).mkdir(parents=True)
        (sup.shard_dir(ref) / "spec.json").write_text(json.dumps(old, indent=2))

        assert sup.recorded() == [ref]
        running = sup.find_running(ref)
        assert running is not None and running.pid == stranger.pid and running.port == 8123
        assert running.group == stranger.pid
        plan = sup.plan_of(ref)
        assert (plan.model, plan.engine, plan.gpu_indices, plan.priority) == (
            "tiny", "vllm", [0, 1], 5,
        )  # fmt: skip
        assert not plan.serves_http and plan.internal_port == 8124 and plan.cpu_bind == "0-3"
        assert plan.ready_probe is not None and plan.ready_probe.completion is not None
        assert sup.used_ports() == {8123, 8124}
        # Nothing lost: the typed record writes back the same file, plus the
        # keys added since, empty.
        loaded = SpecFile.load(sup.shard_dir(ref) / "spec.json")
        assert loaded is not None
        fingerprint = {**old["fingerprint"], "marker": None}  # type: ignore[dict-item]
        spec = {**old["spec"], "endpoint_proofs": False}  # type: ignore[dict-item]
        assert loaded.model_dump(mode="json") == {
            **old, "fingerprint": fingerprint, "group_start_time": None, "spec": spec,
        }  # fmt: skip
        assert loaded.leader_start == started  # the pid led its group
    finally:
        stranger.kill()
        stranger.wait()


def test_older_spec_files_without_later_keys_load_with_defaults(tmp_path: Path) -> None:
    """No pgid (the pid leads the group), no plan keys: defaults, as ``.get`` gave."""
    record = SpecFile.model_validate(
        {"shard": {"replica_id": "older"}, "pid": 42, "port": 1, "endpoint": "x:1", "extra": 1}
    )
    assert record.group == 42 and record.fingerprint is None
    assert record.spec == ShardRecord()
    assert record.spec.serves_http and record.spec.ready_probe is None
    assert SpecFile.load(tmp_path / "missing.json") is None
    (tmp_path / "torn.json").write_text("{")
    assert SpecFile.load(tmp_path / "torn.json") is None


def test_a_group_id_given_to_a_stranger_is_not_killed(tmp_path: Path) -> None:
    """Pids wrap (at 32768 here): once a shard's group is empty its id may be a
    new session's leader, which the leftover sweep must leave alone."""
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="wrapped")
    _launch(sup, ref, "tag-wrapped")
    spec_path = sup.shard_dir(ref) / "spec.json"
    recorded = SpecFile.load(spec_path)
    assert recorded is not None and recorded.group_start_time is not None
    assert recorded.leader_start == recorded.group_start_time
    sup.stop(ref, grace_s=0.5)
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        # The record as if the stranger had been given the group's number.
        spec_path.write_text(recorded.model_copy(update={"pgid": stranger.pid}).model_dump_json())
        assert sup.kill_leftovers(ref) == []
        assert stranger.poll() is None
        # The same record naming the stranger's own start: that is a leftover.
        started = procfs.start_time(stranger.pid)
        forged = recorded.model_copy(update={"pgid": stranger.pid, "group_start_time": started})
        spec_path.write_text(forged.model_dump_json())
        assert sup.kill_leftovers(ref) == [stranger.pid]
        assert stranger.wait(timeout=10) == -9
    finally:
        stranger.kill()
        stranger.wait()


def test_group_reused_compares_the_leader_start() -> None:
    me = os.getpid()
    start = procfs.start_time(me)
    assert start is not None
    assert not procfs.group_reused(me, start)
    assert procfs.group_reused(me, start - 1)
    assert not procfs.group_reused(me, None)  # an old record: not judged


def test_engines_are_titled_with_their_replica(tmp_path: Path) -> None:
    """ps tells which process serves which replica (issue 23 item 14): a native
    program gets the title as its argv[0]; an interpreter keeps its own argv[0]
    (it derives its prefix from it) and gets the title in LLMGW_ENGINE_TITLE."""
    sup = Supervisor(tmp_path)
    ref = ShardRef(replica_id="titled-1", rank=2)
    sleep = shutil.which("sleep")
    assert sleep is not None
    native = Command([sleep, "600"], dict(os.environ))
    python = Command([sys.executable, "-c", "import time; time.sleep(600)", "tag-t"], {})
    sup.launch(ref, [python, native], 1, "x", ShardRecord(engine="llama.cpp"))
    try:
        title = "llmgw llama.cpp replica titled-1 rank 2"
        assert engine_title(ref, "llama.cpp") == title
        # Just after exec a command line can read empty: wait for both.
        assert wait_for(lambda: len(pids_with_args(f"sleep [{title}]", "600")) == 1, 10)
        assert wait_for(lambda: len(pids_with_args("tag-t")) == 1, 10)
        [native_pid] = pids_with_args(f"sleep [{title}]", "600")
        [python_pid] = pids_with_args("tag-t")
        assert Path(f"/proc/{python_pid}/cmdline").read_bytes().startswith(sys.executable.encode())
        for pid in (native_pid, python_pid):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"{TITLE_ENV}={title}".encode() in environ
    finally:
        sup.stop(ref, grace_s=0.5)
