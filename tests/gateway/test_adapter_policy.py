"""Adapter routing decisions, without a router."""

from router.control_link.adapter_policy import (
    Action,
    AdapterUse,
    Choice,
    ReplicaView,
    choose,
    choose_naive,
)


def replica(rid: str, in_flight: int = 0, cap: int = 4, **loaded: AdapterUse) -> ReplicaView:
    return ReplicaView(rid, in_flight=in_flight, cap=cap, max_loaded=2, loaded=dict(loaded))


def test_a_holder_serves_while_not_saturated() -> None:
    rs = [
        replica("r1", 3, a=AdapterUse(1.0)),
        replica("r2", 0),
        replica("r3", 1, a=AdapterUse(2.0)),
    ]
    assert choose("a", rs) == Choice("r3", Action.USE)  # the least loaded holder


def test_a_saturated_holder_makes_another_replica_load() -> None:
    rs = [replica("r1", 4, a=AdapterUse(1.0)), replica("r2", 2), replica("r3", 1)]
    assert choose("a", rs) == Choice("r3", Action.LOAD)


def test_full_replicas_unload_their_least_recently_used_idle_adapter() -> None:
    rs = [
        replica("r1", 1, b=AdapterUse(5.0), c=AdapterUse(1.0, in_flight=1)),
        replica("r2", 2, d=AdapterUse(3.0), e=AdapterUse(4.0)),
    ]
    # r1 is least loaded; its LRU adapter (c) is busy, so b (idle) goes.
    assert choose("a", rs) == Choice("r1", Action.EVICT_AND_LOAD, evict="b")


def test_never_unloads_an_adapter_with_requests_in_flight() -> None:
    rs = [replica("r1", 2, b=AdapterUse(1.0, in_flight=1), c=AdapterUse(2.0, in_flight=1))]
    assert choose("a", rs) is None


def test_all_saturated_means_no_choice() -> None:
    rs = [replica("r1", 4), replica("r2", 4, a=AdapterUse(1.0))]
    assert choose("a", rs) is None


def test_naive_affinity_waits_for_the_busy_holder() -> None:
    rs = [replica("r1", 4, a=AdapterUse(1.0)), replica("r2", 0)]
    assert choose_naive("a", rs) is None
    assert choose("a", rs) == Choice("r2", Action.LOAD)
