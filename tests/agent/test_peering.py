"""Which nodes a fetch asks before the origin (worker_agent/peering.py peers_for)."""

from llmgw.types import FetchWeightsInput, FleetSnapshot, NodeInventory
from llmgw.types.fleet import Placement
from worker_agent.peering import MAX_PEERS, peers_for


def _node(node_id: str, peer_url: str) -> NodeInventory:
    return NodeInventory(
        node_id=node_id,
        hostname=node_id,
        address="10.0.0.1",
        cpu_count=2,
        memory_mib=1024,
        peer_url=peer_url,
    )


def _fleet(*placements: Placement) -> FleetSnapshot:
    nodes = {n: _node(n, f"http://{n}:9000") for n in ("a", "b", "c", "d", "e")}
    nodes["quiet"] = _node("quiet", "")  # serves no peers
    return FleetSnapshot(nodes=nodes, allocations={p.replica_id: p for p in placements})


def test_nodes_of_the_same_models_replicas_oldest_first_never_itself() -> None:
    fleet = _fleet(
        Placement(replica_id="m-1", model="m", node_id="c"),
        Placement(replica_id="x-1", model="x", node_id="b"),
        Placement(replica_id="m-2", model="m", node_id="a"),
        Placement(replica_id="m-3", model="m", node_id="quiet"),
        Placement(replica_id="m-4", model="m", node_id="d"),
    )
    request = FetchWeightsInput(replica_id="m-4", source="hf://o/r", model="m")
    peers = peers_for(fleet, request, "d", "k")
    assert [p.name for p in peers] == ["c", "a"]
    assert peers[0].base_url == "http://c:9000"
    assert peers[0].headers() == {"Authorization": "Bearer k"}


def test_the_workflows_nodes_win_and_the_count_is_bounded() -> None:
    fleet = _fleet(Placement(replica_id="m-1", model="m", node_id="c"))
    request = FetchWeightsInput(
        replica_id="pull", source="hf://o/r", model="m", peer_nodes=["e", "a", "b", "c", "d"]
    )
    assert [p.name for p in peers_for(fleet, request, "a", "k")] == ["e", "b", "c"][:MAX_PEERS]
    assert peers_for(fleet, FetchWeightsInput(replica_id="r", source="s"), "a", "k") == ()


def test_replicas_placed_together_ask_only_those_placed_before_them() -> None:
    """A deploy's replicas fetch at once: the first placed asks no one (the
    origin at once), each other one the nodes placed before it, never a node
    placed after it, whose copy cannot be ahead of its own."""
    fleet = _fleet(
        Placement(replica_id="m-1", model="m", node_id="a"),
        Placement(replica_id="m-2", model="m", node_id="b"),
        Placement(replica_id="m-3", model="m", node_id="c"),
    )

    def asked(replica_id: str, node_id: str) -> list[str]:
        request = FetchWeightsInput(replica_id=replica_id, source="hf://o/r", model="m")
        return [p.name for p in peers_for(fleet, request, node_id, "k")]

    assert asked("m-1", "a") == []
    assert asked("m-2", "b") == ["a"]
    assert asked("m-3", "c") == ["a", "b"]
    assert asked("m-9", "d") == ["a", "b", "c"]  # not placed (yet): all of them
