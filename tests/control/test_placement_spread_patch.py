"""Spreading a model's replicas over nodes replays old histories alike.

Placement runs in the Fleet workflow, so the new first criterion (fewest
ranks of the same model) is behind ``SPREAD_REPLICAS_PATCH``: a history
recorded by a control worker that bin-packed two replicas onto one node
replays to that choice, while new runs spread them. The patch is asked only
once the model holds some room, so first replicas leave no marker.
"""

import uuid

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, Worker

from llmgw.types import ModelSpec, Placement
from tests.harness import node_inventory
from workflows import placement
from workflows.placement import choose_node

CPU = ModelSpec(name="tiny", source="/m.gguf")


@workflow.defn(sandboxed=False)
class SpreadProbe:
    """Places ``count`` replicas of one model on two nodes in workflow code,
    and makes sharing a node a command (a memo), so a replay that chooses
    otherwise fails."""

    @workflow.run
    async def run(self, count: int) -> list[str]:
        nodes = {n: node_inventory(n) for n in ("a", "b")}
        allocs: dict[str, Placement] = {}
        for i in range(count):
            placed = choose_node(f"r{i}", CPU, nodes, allocs).placement
            assert placed is not None
            allocs[f"r{i}"] = placed
        leaders = [p.node_id for p in allocs.values()]
        if len(set(leaders)) < len(leaders):
            workflow.upsert_memo({"shared": ",".join(leaders)})
        return leaders


async def _run(client: Client, queue: str, count: int) -> WorkflowHandle[SpreadProbe, list[str]]:
    return await client.start_workflow(
        SpreadProbe.run, count, id=f"spread-probe-{uuid.uuid4()}", task_queue=queue
    )


async def _markers(handle: WorkflowHandle[SpreadProbe, list[str]]) -> int:
    history = await handle.fetch_history()
    return sum(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED for e in history.events)


async def test_a_placement_from_before_spreading_replays_alike(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = f"spread-probe-{uuid.uuid4()}"
    replayer = Replayer(workflows=[SpreadProbe], data_converter=pydantic_data_converter)
    with monkeypatch.context() as old_code:
        old_code.setattr(placement, "replicas_spread", lambda holds_ranks: False)
        async with Worker(client, task_queue=queue, workflows=[SpreadProbe]):
            old = await _run(client, queue, 2)
            assert await old.result() == ["b", "b"]  # bin-packed, as before
    async with Worker(client, task_queue=queue, workflows=[SpreadProbe]):
        new = await _run(client, queue, 2)
        assert await new.result() == ["b", "a"]
        first_only = await _run(client, queue, 1)
        assert await first_only.result() == ["b"]
    assert (await _markers(old), await _markers(new), await _markers(first_only)) == (0, 1, 0)
    for handle in (old, new, first_only):
        history = await handle.fetch_history()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, f"{handle.id}: {result.replay_failure}"
    # Without the patch, today's rule would diverge from the old history.
    with monkeypatch.context() as ungated:
        ungated.setattr(placement, "replicas_spread", lambda holds_ranks: holds_ranks)
        history = await old.fetch_history()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is not None
