"""Rolling restart: each replica is replaced by one that serves before it goes."""

import asyncio
import subprocess
import sys
from datetime import datetime

from temporalio.client import Client

from llmgw import replicas
from llmgw.types import DeploymentStatus, EngineKind, ModelSpec, ReplicaPhase
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System
from tests.procs_util import pids_with_args
from tests.recording import record

MODEL = "tiny-rolling"


async def _settled(client: Client, old: set[str]) -> DeploymentStatus:
    """The deployment once every slot runs a new, ready replica and the roll is over."""
    async with asyncio.timeout(120):
        while True:
            status = await replicas.deployment_status(client, MODEL)
            ids = {s.replica_id for s in status.slots}
            if (
                not status.rolling
                and len(status.slots) == 2
                and not ids & old
                and all(s.ready and s.replaces is None for s in status.slots)
            ):
                return status
            await asyncio.sleep(0.2)


async def test_rolling_restart_replaces_one_at_a_time(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    system.catalog(spec)
    system.spawn("control")
    system.spawn_agent("roll-node")
    await replicas.wait_node_registered(client, "roll-node", 60)
    await replicas.apply_deployment(client, spec, 2)
    async with asyncio.timeout(120):
        while (
            not all(s.ready for s in (await replicas.deployment_status(client, MODEL)).slots)
            or len((await replicas.deployment_status(client, MODEL)).slots) < 2
        ):
            await asyncio.sleep(0.2)
    old = {s.replica_id for s in (await replicas.deployment_status(client, MODEL)).slots}

    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "llmgw_cli", "restart", MODEL],
        env=system.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    status = await _settled(client, old)

    new_ready = []
    for slot in status.slots:
        final = await replicas.status_of(client, slot.replica_id)
        assert final is not None
        new_ready.append(next(h.at for h in final.history if h.phase is ReplicaPhase.READY))
    for rid in old:
        gone = await replicas.status_of(client, rid)
        assert gone is not None and gone.phase is ReplicaPhase.STOPPED
        drained = next(h.at for h in gone.history if h.phase is ReplicaPhase.DRAINING)
        # Each old replica drained only after some new one served.
        assert min(datetime.fromisoformat(t) for t in new_ready) < datetime.fromisoformat(drained)
    assert len(pids_with_args("--alias", MODEL)) == 2

    await replicas.remove_deployment(client, spec, 60)
    assert pids_with_args("--alias", MODEL) == []
    await record(client, f"deployment/{MODEL}", "deployment_rolling_restart")
