"""Preemption decisions, without Temporal."""

from llmgw.types import EngineKind, ModelSpec, NodeInventory, Placement, Reservation, ShardPlacement
from tests.harness import node_inventory as node
from workflows.placement import choose_node
from workflows.preemption import claims, plan_preemption

LOW = ModelSpec(name="low", source="/m", gpus=2, priority=0)
HIGH = ModelSpec(name="high", source="/m", gpus=4, priority=10)


def alloc(rid: str, node_id: str, gpus: list[int], priority: int = 0) -> Placement:
    return Placement(
        replica_id=rid, model="low", node_id=node_id, gpu_indices=gpus, priority=priority
    )


def test_lowest_priority_victims_first() -> None:
    nodes = {"a": node("a", 4)}
    allocs = {
        "mid": alloc("mid", "a", [0, 1], priority=5),
        "low": alloc("low", "a", [2, 3], priority=1),
    }
    want = HIGH.model_copy(update={"gpus": 2})
    plan = plan_preemption("h1", want, nodes, allocs, {})
    assert plan is not None
    assert plan.victims == ["low"]
    assert plan.placement.gpu_indices == [2, 3]
    assert plan.placement.priority == 10


def test_fewest_victims_across_nodes() -> None:
    nodes = {"a": node("a", 4), "b": node("b", 4)}
    allocs = {
        "a1": alloc("a1", "a", [0, 1]),
        "a2": alloc("a2", "a", [2, 3]),
        "b1": alloc("b1", "b", [0, 1, 2, 3]),
    }
    plan = plan_preemption("h1", HIGH, nodes, allocs, {})
    assert plan is not None and plan.placement.node_id == "b"
    assert plan.victims == ["b1"]


def test_equal_or_higher_priority_is_never_preempted() -> None:
    nodes = {"a": node("a", 4)}
    allocs = {"peer": alloc("peer", "a", [0, 1, 2, 3], priority=10)}
    assert plan_preemption("h1", HIGH, nodes, allocs, {}) is None


def test_not_enough_even_after_preempting_everything() -> None:
    nodes = {"a": node("a", 2)}
    allocs = {"l": alloc("l", "a", [0, 1])}
    assert plan_preemption("h1", HIGH, nodes, allocs, {}) is None


def test_a_victim_is_promised_once_and_reserved_room_is_held() -> None:
    nodes = {"a": node("a", 4)}
    allocs = {"l1": alloc("l1", "a", [0, 1]), "l2": alloc("l2", "a", [2, 3])}
    want = HIGH.model_copy(update={"gpus": 2})
    first = plan_preemption("h1", want, nodes, allocs, {})
    assert first is not None and first.victims == ["l1"]
    reservations = {"h1": first}
    second = plan_preemption("h2", want, nodes, allocs, reservations)
    assert second is not None and second.victims == ["l2"]
    reservations["h2"] = second
    assert plan_preemption("h3", want, nodes, allocs, reservations) is None
    # Once l1 has gone, its GPUs are still held for h1, not offered to others.
    del allocs["l1"]
    result = choose_node("x", LOW, nodes, claims(allocs, reservations))
    assert result.placement is None


def test_cpu_slots_can_be_preempted() -> None:
    nodes = {"a": node("a", 0, cpu_slots=1)}
    allocs = {"l": alloc("l", "a", [])}
    cpu_high = ModelSpec(name="high", source="/m", priority=1)
    plan = plan_preemption("h1", cpu_high, nodes, allocs, {})
    assert plan == Reservation(
        placement=Placement(replica_id="h1", model="high", node_id="a", priority=1),
        victims=["l"],
    )


def _wide(nodes: int = 2, gpus: int = 4, priority: int = 10) -> ModelSpec:
    # vLLM: its ranks keep to one fabric island (llama.cpp's meet over the network).
    return HIGH.model_copy(
        update={
            "engine": EngineKind.VLLM,
            "gpus": gpus,
            "priority": priority,
            "profile": HIGH.profile.model_copy(update={"nodes": nodes}),
        }
    )


def _island(node_id: str, island: str, gpus: int = 4) -> NodeInventory:
    base = node(node_id, gpus)
    return base.model_copy(update={"fabric": base.fabric.model_copy(update={"island": island})})


def test_a_multi_node_replica_preempts_node_by_node_inside_one_island() -> None:
    nodes = {
        "a": _island("a", "ib-1"),
        "b": _island("b", "ib-1"),
        "c": _island("c", "ib-2"),
        "d": _island("d", "ib-2"),
    }
    allocs = {
        # ib-1: one victim each on a and b (2 in all)...
        "a1": alloc("a1", "a", [0, 1, 2, 3], priority=1),
        "b1": alloc("b1", "b", [0, 1, 2, 3], priority=1),
        # ...ib-2: d is free, c holds one victim: fewer, so ib-2 wins.
        "c1": alloc("c1", "c", [0, 1], priority=2),
        "c2": alloc("c2", "c", [2, 3], priority=0),
    }
    plan = plan_preemption("w1", _wide(gpus=2), nodes, allocs, {})
    assert plan is not None
    assert plan.victims == ["c2"]  # lowest priority first, and one is enough
    shards = {s.node_id: s.gpu_indices for s in plan.placement.shards()}
    assert shards == {"d": [0, 1], "c": [2, 3]}
    assert [s.rank for s in plan.placement.shards()] == [0, 1]


def test_a_multi_node_replica_never_spans_islands_to_preempt() -> None:
    nodes = {"a": _island("a", "ib-1"), "b": _island("b", "ib-2")}
    allocs = {"a1": alloc("a1", "a", [0, 1, 2, 3]), "b1": alloc("b1", "b", [0, 1, 2, 3])}
    assert plan_preemption("w1", _wide(), nodes, allocs, {}) is None
    # Each node alone is its own island when the fabric is unknown.
    apart = {"a": node("a", 4), "b": node("b", 4)}
    assert plan_preemption("w1", _wide(), apart, allocs, {}) is None


def test_every_node_of_the_island_must_fit_once_its_victims_go() -> None:
    nodes = {"a": _island("a", "ib"), "b": _island("b", "ib"), "c": _island("c", "ib")}
    allocs = {
        "a1": alloc("a1", "a", [0, 1, 2, 3], priority=1),
        "b1": alloc("b1", "b", [0, 1, 2, 3], priority=20),  # outranks the preemptor
        "c1": alloc("c1", "c", [0, 1, 2, 3], priority=20),
    }
    assert plan_preemption("w1", _wide(), nodes, allocs, {}) is None
    del allocs["c1"]
    plan = plan_preemption("w1", _wide(), nodes, allocs, {})
    assert plan is not None and plan.victims == ["a1"]
    assert {s.node_id for s in plan.placement.shards()} == {"a", "c"}


def test_multi_node_replicas_are_never_victims_and_reserved_room_counts() -> None:
    nodes = {"a": _island("a", "ib"), "b": _island("b", "ib")}
    wide_low = Placement(
        replica_id="wl", model="low", node_id="a", gpu_indices=[0, 1, 2, 3], priority=0,
        workers=[ShardPlacement(rank=1, node_id="b", gpu_indices=[0, 1, 2, 3])],
    )  # fmt: skip
    assert plan_preemption("w1", _wide(), nodes, {"wl": wide_low}, {}) is None
    # Room reserved for one preemptor is not offered to the next.
    allocs = {"a1": alloc("a1", "a", [0, 1, 2, 3]), "b1": alloc("b1", "b", [0, 1, 2, 3])}
    first = plan_preemption("w1", _wide(), nodes, allocs, {})
    assert first is not None and sorted(first.victims) == ["a1", "b1"]
    assert plan_preemption("w2", _wide(), nodes, allocs, {"w1": first}) is None


def test_fleets_from_before_multi_node_preemption_keep_waiting() -> None:
    nodes = {"a": _island("a", "ib"), "b": _island("b", "ib")}
    allocs = {"a1": alloc("a1", "a", [0, 1, 2, 3]), "b1": alloc("b1", "b", [0, 1, 2, 3])}
    assert plan_preemption("w1", _wide(), nodes, allocs, {}, multi_node=False) is None
    assert plan_preemption("w1", _wide(), nodes, allocs, {}) is not None
