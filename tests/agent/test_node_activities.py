"""Node activities against a real llama.cpp engine, without Temporal workers."""

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.agent.shards import NodeActivities
from llmgw.engine_keys import engine_key
from llmgw.types import (
    AdapterSpec,
    EngineKind,
    LaunchShardInput,
    ModelSpec,
    ShardRef,
    ShardSpec,
    StopShardInput,
    WaitReadyInput,
    WatchShardInput,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.conftest import LlamaPath
from tests.harness import cpu_inventory, llama_only, node_activities
from tests.procs_util import pids_with_args
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.launch import Launcher
from worker_agent.shard_service import ShardService
from worker_agent.supervisor import Supervisor
from worker_agent.weights import WeightsCache

SECRET = "test-secret"


ActivitiesFactory = Callable[[Path], NodeActivities]


@pytest.fixture
async def make_acts(llama: LlamaCppInstall) -> AsyncIterator[ActivitiesFactory]:
    """Builds node activities over a work dir; closes them after the test."""
    async with _activities_over(llama) as build:
        yield build


@contextlib.asynccontextmanager
async def _activities_over(llama: LlamaCppInstall) -> AsyncIterator[ActivitiesFactory]:
    made: list[NodeActivities] = []

    def build(work: Path) -> NodeActivities:
        made.append(_activities(llama, work))
        return made[-1]

    yield build
    for acts in made:
        await acts.aclose()


def _activities(llama: LlamaCppInstall, work: Path) -> NodeActivities:
    return node_activities(llama, Supervisor(work), SECRET)


async def test_launch_twice_gives_one_engine(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    """On each llama.cpp install path: the portable server's launcher execs
    python3, and a new agent once took that engine for a stranger."""
    async with _activities_over(llama_path.install) as make_acts:
        await _launch_twice(make_acts, tiny, tmp_path)


async def _launch_twice(make_acts: ActivitiesFactory, tiny: TinyModel, tmp_path: Path) -> None:
    model = ModelSpec(name="tiny-twice", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    spec = ShardSpec(replica_id="twice-1", model=model)
    ref = ShardRef(replica_id="twice-1")
    acts = make_acts(tmp_path)
    env = ActivityEnvironment()

    first = await env.run(acts.launch_shard, LaunchShardInput(spec=spec))
    again = await env.run(acts.launch_shard, LaunchShardInput(spec=spec))
    # An agent restarted on the same work dir finds it too.
    restarted = await env.run(make_acts(tmp_path).launch_shard, LaunchShardInput(spec=spec))
    try:
        assert not first.already_running
        assert again.already_running and again.pid == first.pid
        assert restarted.already_running and restarted.pid == first.pid
        assert pids_with_args("--alias", "tiny-twice") == [first.pid]

        ready = await env.run(acts.wait_shard_ready, WaitReadyInput(shard=ref, timeout_s=60))
        assert ready.model_ids == ["tiny-twice"]
        async with httpx.AsyncClient() as http:
            body = {"prompt": "hi", "max_tokens": 2}
            no_key = await http.post(f"{first.endpoint}/v1/completions", json=body)
            keyed = await http.post(
                f"{first.endpoint}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {engine_key(SECRET, 'twice-1')}"},
            )
        assert no_key.status_code == 401
        assert keyed.status_code == 200
    finally:
        stopped = await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
    assert stopped.was_running
    assert pids_with_args("--alias", "tiny-twice") == []
    second_stop = await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
    assert not second_stop.was_running


def _process_and_spec_text(pid: int, work: Path) -> tuple[str, str, str]:
    proc = Path(f"/proc/{pid}")
    specs = "".join(p.read_text() for p in work.rglob("spec.json"))
    return (proc / "cmdline").read_bytes().decode(), (proc / "environ").read_bytes().decode(), specs


async def test_engine_key_is_not_in_argv_or_spec(
    make_acts: ActivitiesFactory, tiny: TinyModel, tmp_path: Path
) -> None:
    model = ModelSpec(name="tiny-argv", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    ref = ShardRef(replica_id="argv-1")
    acts = make_acts(tmp_path)
    env = ActivityEnvironment()
    handle = await env.run(
        acts.launch_shard, LaunchShardInput(spec=ShardSpec(replica_id="argv-1", model=model))
    )
    try:
        key = engine_key(SECRET, "argv-1")
        cmdline, environ, spec_text = _process_and_spec_text(handle.pid, tmp_path)
        assert key not in cmdline
        assert spec_text and key not in spec_text
        # The engine holds a loopback key of its own, never the replica's
        # (only its pass-through does: tests/agent/test_engine_user_escapes.py).
        assert "LLAMA_API_KEY=" in environ and key not in environ
    finally:
        await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))


async def test_an_engine_whose_pass_through_dies_is_stopped_and_reported(
    make_acts: ActivitiesFactory, tiny: TinyModel, tmp_path: Path
) -> None:
    model = ModelSpec(name="tiny-front", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    ref = ShardRef(replica_id="front-1")
    acts = make_acts(tmp_path)
    env = ActivityEnvironment()
    handle = await env.run(
        acts.launch_shard, LaunchShardInput(spec=ShardSpec(replica_id="front-1", model=model))
    )
    running = Supervisor(tmp_path).find_running(ref)
    assert running is not None and running.group != handle.pid  # the pass-through leads
    try:
        await env.run(acts.wait_shard_ready, WaitReadyInput(shard=ref, timeout_s=60))
        os.kill(running.group, signal.SIGKILL)
        exit_ = await env.run(acts.watch_shard, WatchShardInput(shard=ref, poll_interval_s=0.1))
    finally:
        await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
    assert exit_.reason.startswith("worker_agent.passthrough exited with code -9")
    assert pids_with_args("--alias", "tiny-front") == []


async def test_a_static_adapter_outside_the_weights_roots_is_refused(
    llama: LlamaCppInstall, tiny: TinyModel, tmp_path: Path
) -> None:
    """Adapters loaded at start obey LLMGW_WEIGHTS_ROOTS as weights do: a link
    inside a root that points out is refused, and nothing is started."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.gguf").symlink_to(tiny.adapters["lora-a"])  # the generated adapter lives outside
    acts = NodeActivities(
        ShardService(
            Launcher(
                supervisor=Supervisor(tmp_path / "work"),
                installs=llama_only(llama, tmp_path),
                engine_key=lambda rid: engine_key(SECRET, rid),
                engine_host="127.0.0.1",
                ports=range(41000, 41050),
                inventory=cpu_inventory,
                threads=1,
                weights=WeightsCache(tmp_path / "weights", [root]),
            )
        )
    )
    model = ModelSpec(
        name="tiny-lora-out",
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        adapters=[AdapterSpec(name="a", source=str(root / "a.gguf"))],
    )
    try:
        with pytest.raises(ApplicationError) as caught:
            await ActivityEnvironment().run(
                acts.launch_shard, LaunchShardInput(spec=ShardSpec(replica_id="out-1", model=model))
            )
    finally:
        await acts.aclose()
    assert caught.value.type == "SourceOutsideRoots" and caught.value.non_retryable
    assert "LLMGW_WEIGHTS_ROOTS" in caught.value.message
    assert pids_with_args("--alias", "tiny-lora-out") == []
