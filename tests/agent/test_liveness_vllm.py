"""Engine liveness with a real vLLM (CPU) under the real supervisor: its
engine core frozen (SIGSTOP) mid-generation, as a GPU or NCCL hang leaves
it, while its API server still answers. The watch finds it hung (the
progress figure from vLLM's /metrics stands still with a request in
flight, or /metrics stops answering) and kills the whole group.

Slow by nature (vLLM starts in 15-60 s on 2 cores; the first install takes
minutes, shared with the other vLLM tests through the engine cache).
"""

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import httpx
import pytest

from llmgw.engine_keys import engine_key
from llmgw.types import (
    EngineKind,
    EngineProfile,
    LaunchShardInput,
    ModelSpec,
    ShardRef,
    ShardSpec,
    StopShardInput,
    WaitReadyInput,
    WatchShardInput,
)
from llmgw_cli.dev.tinyhf import TinyHfModel
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import cpu_inventory, engine_cache, free_port
from worker_agent import procfs
from worker_agent.installs.installed import EngineInstalls
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.installs.vllm import VllmInstall
from worker_agent.launch import Launcher
from worker_agent.liveness import ENGINE_HUNG, LivenessRules
from worker_agent.shard_service import ShardService
from worker_agent.supervisor import Supervisor

pytestmark = pytest.mark.timeout(900)

SECRET = "liveness-vllm"


def _engine_core(group: int) -> int:
    """vLLM's engine core process in the shard's group (it titles itself so)."""
    for pid in procfs.group_members(group):
        with contextlib.suppress(OSError):
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"no EngineCore in group {group}")


async def test_a_frozen_vllm_engine_core_is_found_hung_and_killed(
    tinyhf: TinyHfModel,
    tiny: TinyModel,
    llama: LlamaCppInstall,
    vllm_cpu: VllmInstall,
    tmp_path: Path,
) -> None:
    rules = LivenessRules(interval_s=0.5, timeout_s=2.0, rounds=3, unanswered_s=3.0, stall_s=5.0)
    supervisor = Supervisor(tmp_path / "agent")
    start = free_port()
    service = ShardService(
        Launcher(
            supervisor=supervisor,
            installs=EngineInstalls(engine_cache(), llama),
            engine_key=lambda rid: engine_key(SECRET, rid),
            engine_host="127.0.0.1",
            ports=range(start, start + 50),
            inventory=cpu_inventory,
            threads=1,
            cpu_kv_cache_mib=64,
        ),
        liveness=rules,
    )
    model = ModelSpec(
        name="tinyhf-frozen",
        engine=EngineKind.VLLM,
        source=str(tinyhf.path),
        context_length=512,
        engine_args=["--enforce-eager"],  # no torch.compile: minutes on 2 cores
        profile=EngineProfile(device="cpu", dtype="float32"),
    )
    ref = ShardRef(replica_id="vllm-frozen-1")
    key = engine_key(SECRET, ref.replica_id)
    try:
        handle = await service.launch(
            LaunchShardInput(spec=ShardSpec(replica_id=ref.replica_id, model=model)), print
        )
        await service.wait_ready(WaitReadyInput(shard=ref, timeout_s=600), print)
        running = supervisor.find_running(ref)
        assert running is not None
        core = _engine_core(running.group)
        async with httpx.AsyncClient(timeout=600) as client:
            body = {"model": "tinyhf-frozen", "prompt": "hello", "max_tokens": 400}
            headers = {"Authorization": f"Bearer {key}"}
            asked = asyncio.create_task(
                client.post(f"{handle.endpoint}/v1/completions", json=body, headers=headers)
            )
            # In flight (the server counts it running) before the core freezes.
            async with asyncio.timeout(120):
                while True:
                    metrics = await client.get(f"{handle.endpoint}/metrics", headers=headers)
                    if any(
                        line.startswith("vllm:num_requests_running") and not line.endswith(" 0.0")
                        for line in metrics.text.splitlines()
                    ):
                        break
                    assert not asked.done(), "the request ended before the core froze"
                    await asyncio.sleep(0.05)
            os.kill(core, signal.SIGSTOP)
            beats: list[str] = []
            async with asyncio.timeout(180):
                ended = await service.watch(
                    WatchShardInput(shard=ref, poll_interval_s=0.1), beats.append
                )
            print("vLLM hung:", ended.reason)
            assert ended.reason.startswith(ENGINE_HUNG), ended
            assert procfs.group_members(running.group) == []
            assert supervisor.find_running(ref) is None
            with contextlib.suppress(httpx.HTTPError):
                await asyncio.wait_for(asked, 30)  # its connection went with the engine
    finally:
        await service.stop(StopShardInput(shard=ref, grace_s=5))
        await service.aclose()
