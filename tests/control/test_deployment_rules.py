"""Deployment decisions, without Temporal."""

from llmgw.types import RestartPolicy, Slot
from workflows.deployment_rules import backoff_s, should_reap, slots_to_retire

POLICY = RestartPolicy(initial_backoff_s=2, max_backoff_s=30, max_consecutive_failures=3)


def test_backoff_doubles_and_caps() -> None:
    assert [backoff_s(n, POLICY) for n in range(7)] == [0, 2, 4, 8, 16, 30, 30]


def test_a_slot_that_keeps_failing_is_reaped() -> None:
    assert not should_reap(Slot(slot=0, consecutive_failures=2), POLICY)
    assert should_reap(Slot(slot=0, consecutive_failures=3), POLICY)


def test_scale_down_retires_a_reaped_slot_first_then_the_newest() -> None:
    slots = [Slot(slot=0), Slot(slot=1, reaped=True), Slot(slot=2), Slot(slot=3)]
    assert [s.slot for s in slots_to_retire(slots, 1)] == [1, 3, 2]
    assert [s.slot for s in slots_to_retire(slots, 3)] == [1]
    assert slots_to_retire(slots, 4) == []


def test_scale_down_drains_the_least_loaded_serving_replica() -> None:
    serving = [Slot(slot=n, ready=True) for n in range(4)]
    loads = {0: 3.0, 1: 0.0, 2: None, 3: 5.0}  # slot 2's engine could not say
    assert [s.slot for s in slots_to_retire(serving, 2, loads)] == [1, 0]


def test_scale_down_drains_a_replica_not_serving_yet_first() -> None:
    slots = [Slot(slot=0, ready=True), Slot(slot=1, ready=True), Slot(slot=2)]
    assert [s.slot for s in slots_to_retire(slots, 2, {0: 0.0, 1: 0.0})] == [2]
    # Equal loads: the newest goes.
    assert [s.slot for s in slots_to_retire(slots[:2], 1, {0: 0.0, 1: 0.0})] == [1]
