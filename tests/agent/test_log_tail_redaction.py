"""Issue 23 item 6, the node's side: an engine's log tail leaves the node (a
failure reason in a Temporal history, the admin API's log tail, the router's
errors) with the engine key redacted. SGLang prints its ``server_args``,
the API key included; a real llama.cpp engine here, its log carrying the key
as engines print it."""

from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from llmgw.engine_keys import engine_key
from llmgw.types import (
    EngineKind,
    LaunchShardInput,
    LogTailInput,
    ModelSpec,
    ShardRef,
    ShardSpec,
    StopShardInput,
    WaitReadyInput,
    WatchShardInput,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import node_activities
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.launch import new_loopback_key
from worker_agent.shard_service import REDACTED, redacted
from worker_agent.supervisor import Supervisor

SECRET = "test-secret"


def test_printed_keys_are_redacted_in_every_form() -> None:
    key = "k-0123456789"
    loopback = new_loopback_key()  # an engine's own key (worker_agent/launch.py)
    replica_key = engine_key("another-secret", "another-replica")
    lines = [
        f"server_args=ServerArgs(model_path='/m', api_key='{key}', port=30000)",
        "Namespace(model='/m', api_key=['other-key'], port=1)",
        "argv: llama-server --api-key some-key --port 1",
        '{"api_key": "json-key"}',
        f"a line that quotes the key {key} itself",
        f"loopback key {loopback} and a replica key {replica_key}.",
        "kept: load_tensors: CPU_Mapped model buffer size = 0.49 MiB, sha 0123456789abcdef",
    ]
    out = redacted(lines, [key])
    text = "\n".join(out)
    for secret in (key, "other-key", "some-key", "json-key", loopback, replica_key):
        assert secret not in text, text
    assert out[0] == f"server_args=ServerArgs(model_path='/m', api_key='{REDACTED}', port=30000)"
    assert out[2] == f"argv: llama-server --api-key {REDACTED} --port 1"
    assert out[-1] == lines[-1]  # ordinary lines pass as they are


def test_every_loopback_key_is_redacted_exactly() -> None:
    """Each of many loopback keys, however its random part falls (the old form,
    ``token_urlsafe(32)`` matched by its shape, escaped about 1 launch in
    1,500), and nothing else of that length."""
    for _ in range(20_000):
        key = new_loopback_key()
        assert redacted([f"Bearer {key}, ok"], []) == [f"Bearer {REDACTED}, ok"]
    # A digest or an id of a key's length is no key.
    kept = ["sha256 " + "ab12" * 16, "id " + "A" * 21 + "b9_-" + "c" * 18]
    assert redacted(kept, []) == kept


@pytest.mark.timeout(300)
async def test_a_log_tail_leaves_the_node_with_the_key_redacted(
    llama: LlamaCppInstall, tiny: TinyModel, tmp_path: Path
) -> None:
    replica = "redact-1"
    key = engine_key(SECRET, replica)
    model = ModelSpec(name="tiny-redact", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    ref = ShardRef(replica_id=replica)
    sup = Supervisor(tmp_path)
    acts = node_activities(llama, sup, SECRET)
    env = ActivityEnvironment()
    handle = await env.run(
        acts.launch_shard, LaunchShardInput(spec=ShardSpec(replica_id=replica, model=model))
    )
    try:
        await env.run(acts.wait_shard_ready, WaitReadyInput(shard=ref, timeout_s=60))
        # What SGLang prints at start, and a line quoting the key bare.
        with open(sup.shard_dir(ref) / "engine.log", "a") as log:
            log.write(f"server_args=ServerArgs(model_path='/m', api_key='{key}', port=30000)\n")
            log.write(f"auth: expecting Bearer {key}\n")
        assert key in (sup.shard_dir(ref) / "engine.log").read_text()  # the engine's own file

        tail = await env.run(acts.shard_log_tail, LogTailInput(shard=ref, lines=50))
        assert tail.lines and not any(key in line for line in tail.lines)
        assert any(f"api_key='{REDACTED}'" in line for line in tail.lines)

        # The engine dies: the watch's exit reason carries the tail.
        sup.stop(ref, 5.0)
        exited = await env.run(acts.watch_shard, WatchShardInput(shard=ref, poll_interval_s=0.1))
        assert exited.log_tail and not any(key in line for line in exited.log_tail)
        assert any(REDACTED in line for line in exited.log_tail)
        # So does a failed readiness wait (its ApplicationError goes into the history).
        with pytest.raises(ApplicationError) as failed:
            await env.run(acts.wait_shard_ready, WaitReadyInput(shard=ref, timeout_s=5))
        assert "log tail" in str(failed.value) and key not in str(failed.value)
        assert REDACTED in str(failed.value)
    finally:
        await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
        await acts.aclose()
    assert handle.pid
