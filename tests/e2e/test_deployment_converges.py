"""Issue 14's finding 2 with real engines: a deployment of 1 whose catalog
entry turned unplaceable and then good again must end with one replica, not
two, even when something changes while the old replica drains."""

import asyncio

from temporalio.client import Client

from llmgw import replicas
from llmgw.queues import deployment_workflow_id
from llmgw.types import (
    DeploymentStatus,
    EngineKind,
    EngineProfile,
    ModelSpec,
    ReplicaPhase,
    ReplicaTimeouts,
    RestartPolicy,
    ScaleInput,
    SetModelInput,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, wait_deployment
from tests.procs_util import pids_with_args

TIMEOUTS = ReplicaTimeouts(
    place_retry_s=0.3, place_attempts=3, router_grace_s=2, drain_s=10, heartbeat_s=5
)


async def test_bad_then_good_catalog_entry_ends_with_the_desired_count(
    system: System, client: Client, tiny: TinyModel
) -> None:
    good = ModelSpec(name="tiny-conv", source=str(tiny.model_path))
    # As seen: an entry no node can hold (4725 GPUs).
    bad = good.model_copy(update={"engine": EngineKind.VLLM, "profile": EngineProfile(tp=4725)})
    system.catalog(good)
    system.spawn("control")
    # Room for two replicas: a third (the old rule's extra surge) is placed
    # only once the draining one is gone, as on a full GPU node.
    system.spawn_agent("conv-node", {"LLMGW_MAX_CPU_REPLICAS": "2"})
    await replicas.wait_node_registered(client, "conv-node", 60)
    policy = RestartPolicy(initial_backoff_s=0.3, max_consecutive_failures=50)
    await replicas.apply_deployment(client, good, 1, timeouts=TIMEOUTS, restart=policy)
    first = await replicas.wait_deployment_ready(client, good.name, 120)
    handle = client.get_workflow_handle(deployment_workflow_id(good.name))

    # The entry becomes unplaceable (PUT /admin/models with gpus: 4725):
    # the surge replica for it keeps failing placement and backs off.
    await handle.execute_update(
        "set_model", SetModelInput(model=bad, reason="bad entry"), result_type=DeploymentStatus
    )
    await wait_deployment(
        client,
        good.name,
        lambda s: any(sl.replaces is not None and sl.consecutive_failures for sl in s.slots),
        60,
    )
    # Fixed: every slot is rolled onto the good entry again.
    await handle.execute_update(
        "set_model", SetModelInput(model=good, reason="fixed"), result_type=DeploymentStatus
    )
    # While the first replica drains, something else changes (here a scale
    # to the same count; a late notice or a timer does the same).
    async with asyncio.timeout(120):
        while True:
            memo = await replicas.replica_memo(client, first.replica_id)
            if memo is not None and memo.phase is ReplicaPhase.DRAINING:
                break
            await asyncio.sleep(0.05)
    await handle.execute_update("scale", ScaleInput(replicas=1), result_type=DeploymentStatus)

    # Exactly one slot, serving, with no roll left: under the old rule a
    # second surge started for the draining slot and both stayed.
    def steady(s: DeploymentStatus) -> bool:
        return (
            len(s.slots) == 1
            and s.slots[0].ready
            and not s.rolling
            and s.slots[0].replaces is None
            and s.slots[0].replica_id != first.replica_id
        )

    status = await wait_deployment(client, good.name, steady, 120)
    last = await replicas.wait_ready(client, status.slots[0].replica_id, 60)
    assert last.phase is ReplicaPhase.READY
    gone = await replicas.status_of(client, first.replica_id)
    assert gone is not None and gone.phase is ReplicaPhase.STOPPED
    async with asyncio.timeout(60):
        while len(pids_with_args("--alias", good.name)) != 1:
            await asyncio.sleep(0.2)
    await replicas.remove_deployment(client, good, 60)
