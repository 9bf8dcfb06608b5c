"""The fleet's ledger under concurrent placement, on a real Temporal server.

Placements asked for together go as ``place_batch`` updates (through the
control activity's ``Placer``) and are decided by the placement index; the
ledger must come out exactly as the exhaustive scorer, placing the same
requests one by one in the order the fleet saw them, would have made it.
"""

import asyncio
import uuid

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, Worker

from activities.control.placer import Placer
from llmgw import contracts
from llmgw.types import (
    EngineProfile,
    FleetSnapshot,
    ModelSpec,
    NodeFabric,
    NodesQuery,
    PlaceBatch,
    PlaceBatchResult,
    Placement,
    PlaceRequest,
    ReleaseRequest,
    ShardReport,
)
from tests.harness import node_inventory
from workflows.fleet import FleetWorkflow
from workflows.placement import choose_node

SIZES = [1, 2, 4, 1, 8, 2, 1, 1, 4, 2]


def models() -> list[ModelSpec]:
    specs = [ModelSpec(name=f"m{g}", source="/m", gpus=g) for g in SIZES * 4]
    specs += [ModelSpec(name="cpu", source="/m")] * 3
    two = EngineProfile(tp=8, nodes=2)
    specs.append(ModelSpec(name="huge", source="/m", gpus=8, profile=two))
    return specs


async def start_fleet(client: Client, queue: str) -> WorkflowHandle[FleetWorkflow, FleetSnapshot]:
    fleet = await client.start_workflow(
        FleetWorkflow.run, FleetSnapshot(), id=f"fleet-{uuid.uuid4()}", task_queue=queue
    )
    for i in range(6):
        node = node_inventory(f"n{i}", gpus=8, cpu_slots=1)
        node.fabric = NodeFabric(island="ib-1" if i < 3 else "ib-2")
        await contracts.REGISTER_NODE.send(fleet, node)
    return fleet


async def test_batched_placements_match_the_exhaustive_scorer_in_order(client: Client) -> None:
    queue = f"fleet-batch-{uuid.uuid4()}"
    async with Worker(client, task_queue=queue, workflows=[FleetWorkflow]):
        fleet = await start_fleet(client, queue)
        seen: list[PlaceRequest] = []

        async def send(batch: PlaceBatch) -> PlaceBatchResult:
            seen.extend(batch.requests)
            return await contracts.PLACE_BATCH.execute(fleet, batch)

        placer = Placer(send)
        requests = [PlaceRequest(replica_id=f"r{i}", model=m) for i, m in enumerate(models())]
        answers = await asyncio.gather(*(placer.place(r) for r in requests))
        snapshot = await contracts.SNAPSHOT.ask(fleet, None)

        assert len(seen) == len(requests)
        # The reference: the same requests, one by one, in the fleet's order.
        expected: dict[str, Placement] = {}
        for request in seen:
            placement = choose_node(request.replica_id, request.model, snapshot.nodes, expected)
            if placement.placement is not None:
                expected[request.replica_id] = placement.placement
        assert snapshot.allocations == expected
        by_id = {r.replica_id: a for r, a in zip(requests, answers, strict=True)}
        assert {rid: a.placement for rid, a in by_id.items() if a.placement} == expected
        # More was asked than fits: the ones left over say why, node by node.
        unplaced = [a for a in answers if a.placement is None]
        assert unplaced
        assert {r.node_id for r in unplaced[0].rejections} == {f"n{i}" for i in range(6)}

        # Released room is offered again, as the scorer would offer it.
        victim = next(iter(expected))
        released = await contracts.RELEASE.execute(fleet, ReleaseRequest(replica_id=victim))
        assert released.released
        del expected[victim]
        again = ModelSpec(name="m1", source="/m", gpus=1)
        result = await contracts.PLACE.execute(fleet, PlaceRequest(replica_id="again", model=again))
        assert result.placement == choose_node("again", again, snapshot.nodes, expected).placement

        # A launch check reads only the nodes it names.
        some = await contracts.NODES.ask(fleet, NodesQuery(node_ids=["n1", "gone"]))
        assert list(some.nodes) == ["n1"] and some.nodes["n1"] == snapshot.nodes["n1"]

        history = await fleet.fetch_history()
    replayer = Replayer(workflows=[FleetWorkflow], data_converter=pydantic_data_converter)
    replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert replayed.replay_failure is None


async def test_shards_an_agent_reports_are_not_offered_again(client: Client) -> None:
    """A re-registration that adds shards the ledger lacked: the index learns
    them too, and the next placement goes elsewhere."""
    queue = f"fleet-batch-{uuid.uuid4()}"
    async with Worker(client, task_queue=queue, workflows=[FleetWorkflow]):
        fleet = await client.start_workflow(
            FleetWorkflow.run, FleetSnapshot(), id=f"fleet-{uuid.uuid4()}", task_queue=queue
        )
        for name in ("a", "b"):
            await contracts.REGISTER_NODE.send(fleet, node_inventory(name, gpus=8))
        gpu8 = ModelSpec(name="m8", source="/m", gpus=8)
        first = await contracts.PLACE.execute(fleet, PlaceRequest(replica_id="r1", model=gpu8))
        assert first.placement is not None
        other = "a" if first.placement.node_id == "b" else "b"
        # The other node's agent reports an engine holding all its GPUs.
        report = node_inventory(other, gpus=8)
        report.running = [
            ShardReport(replica_id="lost", rank=0, pid=1, endpoint="x", gpu_indices=list(range(8)))
        ]
        await contracts.REGISTER_NODE.send(fleet, report)
        second = await contracts.PLACE.execute(fleet, PlaceRequest(replica_id="r2", model=gpu8))
        assert second.placement is None
        assert {r.reason for r in second.rejections} == {"needs 8 free healthy GPUs, has 0"}


async def test_an_agent_registers_by_signal_with_start(client: Client) -> None:
    """What the agent does at start: the first registration starts the fleet,
    the next joins the running one (``register_node`` through its descriptor)."""
    queue = f"fleet-batch-{uuid.uuid4()}"
    fleet_id = f"fleet-{uuid.uuid4()}"
    async with Worker(client, task_queue=queue, workflows=[FleetWorkflow]):
        handles = [
            await contracts.REGISTER_NODE.send_with_start(
                client,
                contracts.FLEET,
                FleetSnapshot(),
                node_inventory(name, gpus=1),
                id=fleet_id,
                task_queue=queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            )
            for name in ("a", "b")
        ]
        assert handles[0].result_run_id == handles[1].result_run_id  # one fleet run
        fleet = client.get_workflow_handle(fleet_id)
        async with asyncio.timeout(60):  # both signals are in; wait for them to be handled
            while sorted((await contracts.SNAPSHOT.ask(fleet, None)).nodes) != ["a", "b"]:
                await asyncio.sleep(0.05)
        await handles[0].terminate("test over")


async def test_a_node_a_replica_found_lost_is_offered_to_none_until_it_registers(
    client: Client,
) -> None:
    """Found on the network test bed (issue 36 scenario 4): a replica failed
    on a cut-off node released its room, and its replacement, spread to the
    node with none of its model, went straight back to the lost node (the
    fleet's own silence bound, 120 s, had not passed), failed its schedule-to-
    start there, and so on until the deployment reaped the slot."""
    queue = f"fleet-batch-{uuid.uuid4()}"
    async with Worker(client, task_queue=queue, workflows=[FleetWorkflow]):
        fleet = await client.start_workflow(
            FleetWorkflow.run, FleetSnapshot(), id=f"fleet-{uuid.uuid4()}", task_queue=queue
        )
        for name in ("a", "b"):
            await contracts.REGISTER_NODE.send(fleet, node_inventory(name, cpu_slots=2))
        cpu = ModelSpec(name="tiny", source="/m")
        first = await contracts.PLACE.execute(fleet, PlaceRequest(replica_id="r1", model=cpu))
        second = await contracts.PLACE.execute(fleet, PlaceRequest(replica_id="r2", model=cpu))
        assert first.placement is not None and second.placement is not None
        lost = first.placement.node_id
        await contracts.RELEASE.execute(fleet, ReleaseRequest(replica_id="r1", node_lost=lost))
        again = await contracts.PLACE.execute(fleet, PlaceRequest(replica_id="r3", model=cpu))
        assert again.placement is not None and again.placement.node_id != lost
        await contracts.RELEASE.execute(fleet, ReleaseRequest(replica_id="r3"))
        # Its agent registers again: the node is offered again.
        await contracts.REGISTER_NODE.send(fleet, node_inventory(lost, cpu_slots=2))
        back = await contracts.PLACE.execute(fleet, PlaceRequest(replica_id="r4", model=cpu))
        assert back.placement is not None and back.placement.node_id == lost
