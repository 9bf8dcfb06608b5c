"""Placement decisions, without Temporal."""

from datetime import UTC, datetime, timedelta

from llmgw.types import (
    EngineKind,
    EngineProfile,
    FabricKind,
    FleetSnapshot,
    ModelSpec,
    NodeFabric,
    NodeInventory,
    NodeLiveness,
    Placement,
    Rejection,
)
from tests.harness import node_inventory as node
from workflows.placement import Sharing, choose_node, sharing, split_live

CPU = ModelSpec(name="tiny", source="/m.gguf")
GPU2 = ModelSpec(name="big", source="/m", gpus=2)


def test_no_nodes_says_so() -> None:
    result = choose_node("r1", CPU, {}, {})
    assert result.placement is None
    assert result.rejections[0].reason == "no node has registered"


def test_cpu_model_on_cpu_node() -> None:
    result = choose_node("r1", CPU, {"a": node("a")}, {})
    assert result.placement is not None and result.placement.node_id == "a"
    assert result.placement.gpu_indices == []


def test_placement_is_idempotent_per_replica() -> None:
    existing = Placement(replica_id="r1", model="big", node_id="b", gpu_indices=[0, 1])
    result = choose_node("r1", GPU2, {"a": node("a", 8), "b": node("b", 8)}, {"r1": existing})
    assert result.placement == existing


def test_gpus_never_handed_out_twice() -> None:
    nodes = {"a": node("a", 4)}
    allocs: dict[str, Placement] = {}
    for rid in ("r1", "r2"):
        result = choose_node(rid, GPU2, nodes, allocs)
        assert result.placement is not None
        allocs[rid] = result.placement
    assert allocs["r1"].gpu_indices == [0, 1]
    assert allocs["r2"].gpu_indices == [2, 3]
    third = choose_node("r3", GPU2, nodes, allocs)
    assert third.placement is None
    assert third.rejections[0].reason == "needs 2 free healthy GPUs, has 0"


def test_unhealthy_gpus_are_skipped() -> None:
    result = choose_node("r1", GPU2, {"a": node("a", 3, unhealthy=(1,))}, {})
    assert result.placement is not None and result.placement.gpu_indices == [0, 2]


def test_bin_packs_onto_the_busier_node() -> None:
    nodes = {"a": node("a", 8), "b": node("b", 8)}
    allocs = {"r0": Placement(replica_id="r0", model="other", node_id="b", gpu_indices=[0, 1])}
    result = choose_node("r1", GPU2, nodes, allocs)
    assert result.placement is not None and result.placement.node_id == "b"


def _place_all(
    model: ModelSpec, rids: list[str], nodes: dict[str, NodeInventory], allocs: dict[str, Placement]
) -> list[str]:
    """Place each replica in turn; the leader node of each."""
    leaders = []
    for rid in rids:
        placed = choose_node(rid, model, nodes, allocs).placement
        assert placed is not None, rid
        allocs[rid] = placed
        leaders.append(placed.node_id)
    return leaders


def test_replicas_of_one_model_go_to_different_nodes() -> None:
    """Issue 36: both replicas of a model landed on one node, whose loss then
    failed 125 of 145 requests."""
    nodes = {"n1": node("n1"), "n2": node("n2")}
    assert sorted(_place_all(CPU, ["r1", "r2"], nodes, {})) == ["n1", "n2"]
    # GPU replicas too, though the first node has room for both.
    gpu_nodes = {"a": node("a", 8), "b": node("b", 8)}
    assert sorted(_place_all(GPU2, ["g1", "g2"], gpu_nodes, {})) == ["a", "b"]


def test_a_different_model_still_bin_packs_onto_the_busy_node() -> None:
    nodes = {"a": node("a", 8), "b": node("b", 8)}
    allocs: dict[str, Placement] = {}
    assert _place_all(GPU2, ["big-1", "big-2"], nodes, allocs) == ["b", "a"]
    # Both nodes hold one rank of "big": another model packs onto the busier
    # one (b, also holding "other-1"), and its second replica goes to a.
    other = GPU2.model_copy(update={"name": "other"})
    allocs["x"] = Placement(replica_id="x", model="third", node_id="b", gpu_indices=[6, 7])
    assert _place_all(other, ["other-1", "other-2"], nodes, allocs) == ["b", "a"]


def test_more_replicas_than_nodes_share_evenly() -> None:
    nodes = {n: node(n) for n in ("a", "b")}
    leaders = _place_all(CPU, ["r1", "r2", "r3", "r4"], nodes, {})
    assert sorted(leaders) == ["a", "a", "b", "b"]


def test_a_replica_shares_a_node_only_when_no_other_fits() -> None:
    nodes = {"n1": node("n1"), "n2": node("n2", cpu_slots=1)}
    allocs = {
        "r-a": Placement(replica_id="r-a", model="tiny", node_id="n1"),
        "busy": Placement(replica_id="busy", model="other", node_id="n2"),
    }
    result = choose_node("r-b", CPU, nodes, allocs)
    assert result.placement is not None and result.placement.node_id == "n1"
    assert [(r.node_id, r.reason) for r in result.rejections] == [
        ("n2", "CPU replica slots full (1/1)")
    ]
    # What explain says of a new replica, and of the two once placed.
    (new,) = sharing(CPU, nodes, allocs, [], result)
    assert new == Sharing(
        node_id="n1",
        replicas=["r-a"],
        new_replica=True,
        reason="no other node fits (n2: CPU replica slots full (1/1))",
    )
    allocs["r-b"] = result.placement
    cordoned = [Rejection(node_id="n3", reason="cordoned")]
    (placed,) = sharing(CPU, nodes, allocs, cordoned)
    assert (placed.node_id, placed.replicas, placed.new_replica) == ("n1", ["r-a", "r-b"], False)
    assert placed.reason == "no other node fits (n2: CPU replica slots full (1/1); n3: cordoned)"
    # Room on n2 again: the sharing is no longer needed, and explain says how to end it.
    del allocs["busy"]
    (movable,) = sharing(CPU, nodes, allocs, [])
    assert movable.reason == (
        "another node fits one of them now (n2): stopping r-b would have its deployment "
        "place it there"
    )


def test_sharing_with_as_many_replicas_everywhere_names_them() -> None:
    nodes = {n: node(n) for n in ("a", "b")}
    allocs: dict[str, Placement] = {}
    _place_all(CPU, ["r1", "r2", "r3"], nodes, allocs)
    found = sharing(CPU, nodes, allocs, [])
    assert [(s.node_id, s.replicas) for s in found] == [("b", ["r1", "r3"])]
    assert found[0].reason == "no other node with fewer of them fits (a: holds r2)"
    assert sharing(CPU, nodes, {k: allocs[k] for k in ("r1", "r2")}, []) == []


def test_multi_node_replicas_of_one_model_use_other_nodes_and_islands() -> None:
    wide = {n: on_island(node(n, 16), "fabric:ib-1") for n in ("a", "b", "c", "d")}
    allocs: dict[str, Placement] = {}
    first = choose_node("w1", TWO_NODE, wide, allocs).placement
    assert first is not None and [s.node_id for s in first.shards()] == ["d", "c"]
    allocs["w1"] = first
    second = choose_node("w2", TWO_NODE, wide, allocs).placement
    assert second is not None and [s.node_id for s in second.shards()] == ["b", "a"]
    # Across islands: the island holding none of the model's ranks wins,
    # though the other is busier.
    two = {
        "a": on_island(node("a", 16), "fabric:ib-1"),
        "b": on_island(node("b", 16), "fabric:ib-1"),
        "c": on_island(node("c", 16), "fabric:ib-2"),
        "d": on_island(node("d", 16), "fabric:ib-2"),
    }
    held: dict[str, Placement] = {}
    placed = choose_node("w1", TWO_NODE, two, held).placement
    assert placed is not None and {s.node_id for s in placed.shards()} == {"c", "d"}
    held["w1"] = placed
    again = choose_node("w2", TWO_NODE, two, held).placement
    assert again is not None and {s.node_id for s in again.shards()} == {"a", "b"}


def test_rejections_name_every_node() -> None:
    nodes = {"a": node("a", 1), "b": node("b", cpu_slots=0)}
    result = choose_node("r1", GPU2, nodes, {})
    assert result.placement is None
    assert {r.node_id: r.reason for r in result.rejections} == {
        "a": "needs 2 free healthy GPUs, has 1",
        "b": "needs 2 free healthy GPUs, has 0",
    }
    cpu = choose_node("r2", CPU, {"b": node("b", cpu_slots=0)}, {})
    assert cpu.rejections[0].reason == "CPU replica slots full (0/0)"


def on_island(n: NodeInventory, island: str) -> NodeInventory:
    n.fabric = NodeFabric(kind=FabricKind.INFINIBAND, island=island)
    return n


# vLLM: its ranks meet over the fabric (NCCL), so they keep to one island;
# llama.cpp's meet over the network (test_placement_network_ranks.py).
TWO_NODE = ModelSpec(
    name="huge",
    engine=EngineKind.VLLM,
    source="/m",
    gpus=8,
    profile=EngineProfile(tp=8, nodes=2),
)


def test_multi_node_replica_stays_in_one_island() -> None:
    nodes = {
        "a": on_island(node("a", 8), "fabric:ib-1"),
        "b": on_island(node("b", 8), "fabric:ib-2"),
        "c": on_island(node("c", 8), "fabric:ib-2"),
    }
    result = choose_node("r1", TWO_NODE, nodes, {})
    assert result.placement is not None
    ranks = [(s.rank, s.node_id, len(s.gpu_indices)) for s in result.placement.shards()]
    assert ranks == [(0, "c", 8), (1, "b", 8)]
    assert {r.node_id: r.reason for r in result.rejections} == {
        "a": "island fabric:ib-1 has 1 usable nodes, needs 2"
    }


def test_multi_node_ranks_hold_gpus_on_every_node() -> None:
    nodes = {n: on_island(node(n, 8), "fabric:ib") for n in ("a", "b")}
    first = choose_node("r1", TWO_NODE, nodes, {})
    assert first.placement is not None
    second = choose_node("r2", TWO_NODE, nodes, {"r1": first.placement})
    assert second.placement is None
    assert {r.reason for r in second.rejections} == {"needs 8 free healthy GPUs, has 0"}


def test_nodes_without_fabric_are_islands_of_their_own() -> None:
    nodes = {n: node(n, 8) for n in ("a", "b")}
    result = choose_node("r1", TWO_NODE, nodes, {})
    assert result.placement is None
    assert all("needs 2" in r.reason for r in result.rejections)


def test_silent_and_deregistered_nodes_are_not_offered() -> None:
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    state = FleetSnapshot(
        cordoned=["maintenance"],
        nodes={n: node(n) for n in ("fresh", "silent", "gone", "maintenance")},
        liveness={
            "fresh": NodeLiveness(last_seen=(now - timedelta(seconds=20)).isoformat()),
            "silent": NodeLiveness(last_seen=(now - timedelta(seconds=600)).isoformat()),
            "gone": NodeLiveness(last_seen=now.isoformat(), up=False),
            "maintenance": NodeLiveness(last_seen=now.isoformat()),
        },
    )
    live, down = split_live(state, now)
    assert list(live) == ["fresh"]
    assert {r.node_id: r.reason for r in down} == {
        "silent": "agent silent for 600s",
        "gone": "agent shut down (deregistered)",
        "maintenance": "cordoned",
    }


def test_spread_prefers_the_idle_node() -> None:
    nodes = {"a": node("a", 8), "b": node("b", 8)}
    allocs = {"r0": Placement(replica_id="r0", model="other", node_id="b", gpu_indices=[0, 1])}
    spread = GPU2.model_copy(update={"spread": True})
    result = choose_node("r1", spread, nodes, allocs)
    assert result.placement is not None and result.placement.node_id == "a"
    packed = choose_node("r1", GPU2, nodes, allocs)
    assert packed.placement is not None and packed.placement.node_id == "b"


def test_gpu_class_filter_names_what_the_node_has() -> None:
    a100 = node("a", 4)
    for g in a100.gpus:
        g.gpu_class = "a100-80g"
    h100 = node("b", 4)
    for g in h100.gpus:
        g.gpu_class = "h100-80g"
    want = GPU2.model_copy(update={"gpu_class": "h100-80g"})
    result = choose_node("r1", want, {"a": a100, "b": h100}, {})
    assert result.placement is not None and result.placement.node_id == "b"
    assert [(r.node_id, r.reason) for r in result.rejections] == [
        ("a", "needs h100-80g GPUs, has a100-80g")
    ]


def test_gpu_class_counts_only_gpus_of_that_class() -> None:
    mixed = node("a", 4)
    for g in mixed.gpus:
        g.gpu_class = "h100-80g" if g.index < 1 else "l40s-45g"
    want = GPU2.model_copy(update={"gpu_class": "h100-80g"})
    result = choose_node("r1", want, {"a": mixed}, {})
    assert result.placement is None
    assert result.rejections[0].reason == "needs 2 free healthy GPUs, has 1"


def test_placement_records_priority() -> None:
    urgent = GPU2.model_copy(update={"priority": 7})
    result = choose_node("r1", urgent, {"a": node("a", 2)}, {})
    assert result.placement is not None and result.placement.priority == 7
