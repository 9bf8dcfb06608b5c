"""Recovery with real engines: catalog drift, a lost ledger, a terminated replica."""

import asyncio
from collections.abc import Awaitable, Callable

from temporalio.client import Client

from llmgw import replicas
from llmgw.queues import FLEET_WORKFLOW_ID, replica_workflow_id
from llmgw.store import Store
from llmgw.types import DeploymentStatus, ModelSpec, ReplicaPhase, RestartPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System
from tests.procs_util import pids_with_args

FAST_RECOVERY = {"LLMGW_RECONCILE_INTERVAL_S": "0.5", "LLMGW_RECONCILE_CATALOG": "true"}
FAST_AGENT = {"LLMGW_REGISTER_INTERVAL_S": "0.5"}


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 90) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.2)


async def test_catalog_drift_stops_or_rolls_what_runs(
    system: System, client: Client, tiny: TinyModel
) -> None:
    deployed = ModelSpec(name="tiny-drift-dep", source=str(tiny.model_path))
    loose = ModelSpec(name="tiny-drift-loose", source=str(tiny.model_path))
    system.catalog(deployed, loose)
    system.spawn("control", FAST_RECOVERY)
    system.spawn_agent("drift-node", FAST_AGENT)
    await replicas.wait_node_registered(client, "drift-node", 60)
    await replicas.apply_deployment(client, deployed, 1, restart=RestartPolicy())
    first = await replicas.wait_deployment_ready(client, deployed.name, 120)
    loose_id = await replicas.start_replica(client, loose)
    await replicas.wait_ready(client, loose_id, 120)

    # The deployed model's entry changes: the deployment rolls onto it.
    store = Store(system.store_url)
    changed = deployed.model_copy(update={"context_length": 256})
    store.put_model(changed)

    async def rolled() -> bool:
        status = await replicas.deployment_status(client, deployed.name)
        slot = status.slots[0] if len(status.slots) == 1 else None
        return (
            status.model_digest == changed.digest()
            and slot is not None
            and slot.replica_id != first.replica_id
            and slot.ready
        )

    await _until(rolled)
    status = await replicas.deployment_status(client, deployed.name)

    async def reported() -> bool:
        snap = await replicas.fleet_snapshot(client)
        shards = {s.replica_id: s for s in snap.nodes["drift-node"].running}
        new = shards.get(status.slots[0].replica_id)
        return new is not None and new.catalog_digest == changed.digest()

    await _until(reported)
    assert len(pids_with_args("--alias", deployed.name)) == 1

    # The loose replica's entry changes: nothing owns it, so it is stopped.
    store.put_model(loose.model_copy(update={"context_length": 256}))
    final = await replicas.status_of(client, loose_id)

    async def loose_stopped() -> bool:
        nonlocal final
        final = await replicas.status_of(client, loose_id)
        return final is not None and final.phase is ReplicaPhase.STOPPED

    await _until(loose_stopped)
    assert final is not None and final.reason == f"model {loose.name} changed in the catalog"

    # The deployed model leaves the catalog: its deployment scales to zero and ends.
    assert store.delete_model(deployed.name)
    store.close()
    handle = client.get_workflow_handle(f"deployment/{deployed.name}", result_type=DeploymentStatus)
    ended = await asyncio.wait_for(handle.result(), 90)
    assert ended.desired == 0 and ended.slots == []
    assert pids_with_args("--alias", deployed.name) == []
    assert pids_with_args("--alias", loose.name) == []


async def test_lost_ledger_is_rebuilt_and_dead_replicas_release_their_room(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name="tiny-ledger", source=str(tiny.model_path))
    await _ledger_only_system(system, client, "ledger-node")
    kept = await replicas.start_replica(client, spec)
    doomed = await replicas.start_replica(client, spec)
    for rid in (kept, doomed):
        await replicas.wait_ready(client, rid, 120)
    doomed_memo = await replicas.wait_ready(client, doomed, 10)
    doomed_port = doomed_memo.endpoint.rsplit(":", 1)[1]
    assert len(_serving(doomed_port)) == 1

    # The fleet workflow (and with it the ledger) is lost; the agent's next
    # registration starts a new one, and what the node runs is recorded again.
    await client.get_workflow_handle(FLEET_WORKFLOW_ID).terminate("test: ledger lost")

    async def rebuilt() -> bool:
        try:
            snap = await replicas.fleet_snapshot(client)
        except Exception:
            return False
        return {kept, doomed} <= set(snap.allocations)

    await _until(rebuilt)
    snap = await replicas.fleet_snapshot(client)
    assert snap.allocations[kept].node_id == "ledger-node"

    # A replica workflow terminated by hand never stops its engine nor releases
    # its room: the agent stops the engine, the reconcile pass the allocation.
    await client.get_workflow_handle(replica_workflow_id(doomed)).terminate("test: gone")

    async def released() -> bool:
        snap = await replicas.fleet_snapshot(client)
        return doomed not in snap.allocations and kept in snap.allocations

    await _until(released)
    await _until(lambda: _none_running(doomed_port))
    stopped = await replicas.stop_replica(client, kept, "test done", 60)
    assert stopped.phase is ReplicaPhase.STOPPED
    assert kept not in (await replicas.fleet_snapshot(client)).allocations


def _serving(port: str) -> list[int]:
    """The process at a replica's published port: its engine's pass-through."""
    return pids_with_args(f"--listen 127.0.0.1:{port} ")


async def _ledger_only_system(system: System, client: Client, node: str) -> None:
    """A control worker auditing only the ledger, fast, and one agent."""
    system.spawn("control", FAST_RECOVERY | {"LLMGW_RECONCILE_CATALOG": "false"})
    system.spawn_agent(node, FAST_AGENT)
    await replicas.wait_node_registered(client, node, 60)


async def _none_running(port: str) -> bool:
    return _serving(port) == []


async def test_replicas_of_a_terminated_deployment_are_stopped(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name="tiny-parentless", source=str(tiny.model_path))
    await _ledger_only_system(system, client, "parentless-node")
    await replicas.apply_deployment(client, spec, 1)
    memo = await replicas.wait_deployment_ready(client, spec.name, 120)
    # Terminated, a deployment cannot drain its replicas (they outlive its runs).
    await client.get_workflow_handle(f"deployment/{spec.name}").terminate("test: gone")

    async def stopped() -> bool:
        final = await replicas.status_of(client, memo.replica_id)
        return final is not None and final.phase is ReplicaPhase.STOPPED

    await _until(stopped)
    final = await replicas.status_of(client, memo.replica_id)
    assert (
        final is not None and final.reason == f"its deployment (deployment/{spec.name}) has ended"
    )
    assert pids_with_args("--alias", spec.name) == []
