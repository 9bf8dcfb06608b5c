"""Preemption decisions, without Temporal."""

from llmgw.types import ModelSpec, Placement, Reservation
from tests.test_placement import node
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


def test_multi_node_replicas_do_not_preempt() -> None:
    nodes = {"a": node("a", 4)}
    allocs = {"l": alloc("l", "a", [0, 1, 2, 3])}
    wide = HIGH.model_copy(update={"profile": HIGH.profile.model_copy(update={"nodes": 2})})
    assert plan_preemption("h1", wide, nodes, allocs, {}) is None
