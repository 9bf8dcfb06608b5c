"""Placement skips nodes whose engine install cannot run the replica, saying why.

A multi-node llama.cpp replica needs the RPC server on every node; the
portable (AVX2) install has none, and before this the start failed on the
node with "cannot start ggml-rpc-server: No such file".
"""

from llmgw.types import (
    EngineCapability,
    EngineKind,
    EngineProfile,
    ModelSpec,
    NodeFabric,
    NodeInventory,
)
from tests.harness import node_inventory
from workflows.placement import choose_node
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
