"""Killing the control plane mid-start resumes the start and never double-launches."""

import asyncio
import signal
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmgw import replicas
from llmgw.queues import replica_workflow_id
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from tests.harness import System
from tests.procs_util import pids_with_args

MODEL = "tiny-durable"


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (cheap enough to poll every ms)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


async def _wait_engine_spawned(agent: Child) -> None:
    """Return as soon as the agent's launch activity has spawned the engine.

    The start is far too quick (tens of ms) to catch through Temporal's API;
    the engine appearing as the agent's child is the moment the launch began.
    """
    async with asyncio.timeout(60):
        while True:
            if await asyncio.to_thread(_children, agent.pid):
                return
            await asyncio.sleep(0.001)


async def test_sigkill_control_worker_mid_start(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    first = system.spawn("control")
    agent = system.spawn("agent", {"LLMGW_NODE_ID": "durable-node"})
    await replicas.wait_node_registered(client, "durable-node", 60)
    replica_id = await replicas.start_replica(client, spec)

    await _wait_engine_spawned(agent)
    # Freeze the agent so the start cannot progress past the launch while
    # the control worker dies; Ready needs the agent's readiness check.
    agent.signal(signal.SIGSTOP)
    first.signal(signal.SIGKILL)
    first.proc.wait()
    memo = await replicas.replica_memo(client, replica_id)
    agent.signal(signal.SIGCONT)
    assert memo is not None and memo.phase is not ReplicaPhase.READY, "killed too late"

    second = system.spawn("control")
    ready = await replicas.wait_ready(client, replica_id, 120)
    assert ready.phase is ReplicaPhase.READY
    assert len(pids_with_args("--alias", MODEL)) == 1

    # The start really was finished by the second worker, not the first.
    handle = client.get_workflow_handle(replica_workflow_id(replica_id))
    identities = {
        e.workflow_task_completed_event_attributes.identity
        async for e in handle.fetch_history_events()
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    }
    assert any(str(second.pid) in i for i in identities)
    assert any(str(first.pid) in i for i in identities)

    final = await replicas.stop_replica(client, replica_id, "test over", 30)
    assert final.phase is ReplicaPhase.STOPPED
    assert pids_with_args("--alias", MODEL) == []
