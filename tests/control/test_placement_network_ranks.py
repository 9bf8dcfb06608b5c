"""A multi-node llama.cpp replica is placed on nodes of different islands.

Its ranks meet over TCP (ggml RPC), not a fabric; but a node with no RDMA
port is its own island (``node:<address>``), so on a real network (issue 36
scenario 2, two hosts of the test bed) placement refused it on every node
with "island node:198.18.0.18 has 1 usable nodes, needs 2". On loopback every
agent had the address 127.0.0.1, hence one island, which hid it.
"""

import uuid

import pytest
from temporalio import workflow
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, Worker

from llmgw.types import (
    EngineCapability,
    EngineKind,
    EngineProfile,
    ModelSpec,
    NodeFabric,
    NodeInventory,
)
from tests.harness import node_inventory
from workflows import placement
from workflows.placement import choose_node
from workflows.placement_index import PlacementIndex

TWO_NODES = ModelSpec(
    name="tiny2", engine=EngineKind.LLAMA_CPP, source="/m.gguf", profile=EngineProfile(nodes=2)
)


def node(node_id: str, address: str) -> NodeInventory:
    """A CPU node with no RDMA port, as the agent reports it: its own island."""
    inv = node_inventory(node_id)
    inv.fabric = NodeFabric(management_address=address, island=f"node:{address}")
    inv.capabilities = [EngineCapability.LLAMA_CPP_RPC]
    return inv


NODES = [node("n1", "198.18.0.18"), node("n2", "198.18.0.19")]


def test_llama_cpp_ranks_span_nodes_of_different_islands() -> None:
    nodes = {n.node_id: n for n in NODES}
    result = choose_node("r1", TWO_NODES, nodes, {})
    assert result.placement is not None, result.rejections
    assert {s.node_id for s in result.placement.shards()} == {"n1", "n2"}
    chosen = PlacementIndex(nodes).choose("r1", TWO_NODES)
    assert chosen is not None and {s.node_id for s in chosen.shards()} == {"n1", "n2"}


def test_ranks_over_a_fabric_still_keep_to_one_island() -> None:
    vllm = TWO_NODES.model_copy(update={"engine": EngineKind.VLLM})
    result = choose_node("r1", vllm, {n.node_id: n for n in NODES}, {})
    assert result.placement is None
    assert all("has 1 usable nodes, needs 2" in r.reason for r in result.rejections)


@workflow.defn(sandboxed=False)
class NetworkPlaceProbe:
    """Places a two-node llama.cpp replica in workflow code, and makes the
    choice a command (a memo), so a replay that chooses otherwise fails."""

    @workflow.run
    async def run(self, nodes: list[NodeInventory]) -> list[str]:
        result = choose_node("r1", TWO_NODES, {n.node_id: n for n in nodes}, {})
        chosen = [] if result.placement is None else [s.node_id for s in result.placement.shards()]
        if chosen:
            workflow.upsert_memo({"placed": ",".join(chosen)})
        return chosen


async def test_a_refusal_from_before_the_rule_replays_alike(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A control worker from before (simulated: the rule off) refused the
    replica; today's code replays that history to the same refusal
    (NETWORK_RANKS_PATCH), while new runs place it."""
    queue = f"network-probe-{uuid.uuid4()}"
    replayer = Replayer(workflows=[NetworkPlaceProbe], data_converter=pydantic_data_converter)
    with monkeypatch.context() as old_code:
        old_code.setattr(placement, "ranks_over_network", lambda model: False)
        async with Worker(client, task_queue=queue, workflows=[NetworkPlaceProbe]):
            old = await client.start_workflow(
                NetworkPlaceProbe.run, NODES, id=f"probe-old-{uuid.uuid4()}", task_queue=queue
            )
            assert await old.result() == []
    async with Worker(client, task_queue=queue, workflows=[NetworkPlaceProbe]):
        new = await client.start_workflow(
            NetworkPlaceProbe.run, NODES, id=f"probe-new-{uuid.uuid4()}", task_queue=queue
        )
        assert sorted(await new.result()) == ["n1", "n2"]
    for handle in (old, new):
        history = await handle.fetch_history()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, f"{handle.id}: {result.replay_failure}"
