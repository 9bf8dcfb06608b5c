"""Placement skips nodes whose engine install cannot run the replica, saying why.

A multi-node llama.cpp replica needs the RPC server on every node; the
portable (AVX2) install has none, and before this the start failed on the
node with "cannot start ggml-rpc-server: No such file".
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
from workflows.placement import capability_gap, choose_node
from workflows.placement_index import PlacementIndex
from workflows.preemption import plan_preemption

TWO_NODES = ModelSpec(
    name="tiny2", engine=EngineKind.LLAMA_CPP, source="/m.gguf", profile=EngineProfile(nodes=2)
)
ONE_NODE = ModelSpec(name="tiny", engine=EngineKind.LLAMA_CPP, source="/m.gguf")
RPC = [EngineCapability.LLAMA_CPP_RPC]


def node(node_id: str, capabilities: list[EngineCapability] | None) -> NodeInventory:
    inv = node_inventory(node_id)
    inv.fabric = NodeFabric(island="rack-1")  # one island: the nodes may form a replica
    inv.capabilities = capabilities
    return inv


def test_nodes_without_the_rpc_server_are_skipped_with_the_reason() -> None:
    nodes = {"a": node("a", []), "b": node("b", RPC), "c": node("c", RPC)}
    result = choose_node("r1", TWO_NODES, nodes, {})
    assert result.placement is not None
    assert {s.node_id for s in result.placement.shards()} == {"b", "c"}
    (skipped,) = result.rejections
    assert skipped.node_id == "a"
    assert "no RPC server" in skipped.reason and "llama.cpp-rpc" in skipped.reason
    index = PlacementIndex(nodes)
    chosen = index.choose("r1", TWO_NODES)
    assert chosen is not None and {s.node_id for s in chosen.shards()} == {"b", "c"}


def test_a_fleet_of_portable_installs_refuses_a_multi_node_llama_cpp_replica() -> None:
    nodes = {"a": node("a", []), "b": node("b", [])}
    result = choose_node("r1", TWO_NODES, nodes, {})
    assert result.placement is None
    assert {r.node_id for r in result.rejections} == {"a", "b"}
    assert all("no RPC server" in r.reason for r in result.rejections)
    assert PlacementIndex(nodes).choose("r1", TWO_NODES) is None
    assert plan_preemption("r1", TWO_NODES, nodes, {}, {}, multi_node=True) is None


def test_one_node_replicas_and_old_agents_are_not_affected() -> None:
    # A one-node replica needs no RPC server.
    assert choose_node("r1", ONE_NODE, {"a": node("a", [])}, {}).placement is not None
    # An agent from before capabilities were reported (None) is placed as before.
    old = {"a": node("a", None), "b": node("b", None)}
    assert choose_node("r1", TWO_NODES, old, {}).placement is not None
    assert PlacementIndex(old).choose("r1", TWO_NODES) is not None


def test_the_decision_alone() -> None:
    """``capability_gap``, the pure rule, whatever the workflow's patch says."""
    assert capability_gap(node("a", []), TWO_NODES) is not None
    assert capability_gap(node("a", RPC), TWO_NODES) is None
    assert capability_gap(node("a", None), TWO_NODES) is None  # an older agent
    assert capability_gap(node("a", []), ONE_NODE) is None
    vllm = TWO_NODES.model_copy(update={"engine": EngineKind.VLLM})
    assert capability_gap(node("a", []), vllm) is None


@workflow.defn(sandboxed=False)
class PlaceProbe:
    """Places a two-node llama.cpp replica in workflow code, and makes the
    choice a command (a memo), so a replay that chooses otherwise fails."""

    @workflow.run
    async def run(self, nodes: list[NodeInventory]) -> list[str]:
        result = choose_node("r1", TWO_NODES, {n.node_id: n for n in nodes}, {})
        chosen = [] if result.placement is None else [s.node_id for s in result.placement.shards()]
        if chosen:
            workflow.upsert_memo({"placed": ",".join(chosen)})
        return chosen


async def test_a_placement_from_before_the_capability_filter_replays_alike(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A control worker from before capabilities were checked (simulated: the
    check off) placed a replica on a node without the RPC server; today's code
    replays that history to the same choice (CAPABILITIES_PATCH), while new
    runs check capabilities. Without the patch, the replay diverges."""
    nodes = [node("a", []), node("b", RPC)]
    queue = f"place-probe-{uuid.uuid4()}"
    replayer = Replayer(workflows=[PlaceProbe], data_converter=pydantic_data_converter)
    with monkeypatch.context() as old_code:
        old_code.setattr(placement, "capabilities_checked", lambda model: False)
        async with Worker(client, task_queue=queue, workflows=[PlaceProbe]):
            old = await client.start_workflow(
                PlaceProbe.run, nodes, id=f"probe-old-{uuid.uuid4()}", task_queue=queue
            )
            assert sorted(await old.result()) == ["a", "b"]
    async with Worker(client, task_queue=queue, workflows=[PlaceProbe]):
        new = await client.start_workflow(
            PlaceProbe.run, nodes, id=f"probe-new-{uuid.uuid4()}", task_queue=queue
        )
        assert await new.result() == []  # a is turned down, and no other node fits
    for handle in (old, new):
        history = await handle.fetch_history()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, f"{handle.id}: {result.replay_failure}"
