"""Replica lifecycle rules, without Temporal."""

import pytest

from llmgw.types import ReplicaPhase, ReplicaStatus
from workflows.replica_state import (
    MAX_HISTORY,
    IllegalTransition,
    is_terminal,
    memo_of,
    routable,
    transition,
)

P = ReplicaPhase


def fresh() -> ReplicaStatus:
    return ReplicaStatus(replica_id="r1", model="m", phase=P.PLACING)


def test_happy_path_records_history() -> None:
    s = fresh()
    for phase in (P.STARTING, P.LOADING, P.READY, P.DRAINING, P.STOPPING, P.STOPPED):
        transition(s, phase, "t", phase.value)
    assert [h.phase for h in s.history] == [
        P.STARTING,
        P.LOADING,
        P.READY,
        P.DRAINING,
        P.STOPPING,
        P.STOPPED,
    ]
    assert is_terminal(s.phase)


@pytest.mark.parametrize(
    ("start", "bad"),
    [(P.PLACING, P.READY), (P.STARTING, P.READY), (P.STOPPED, P.STARTING), (P.FAILED, P.READY)],
)
def test_illegal_transitions_raise(start: ReplicaPhase, bad: ReplicaPhase) -> None:
    s = fresh()
    s.phase = start
    with pytest.raises(IllegalTransition):
        transition(s, bad, "t")


def test_ready_and_node_lost_are_routable() -> None:
    # A lost node's engine keeps serving; the router's probe vouches for it.
    assert [p for p in P if routable(p)] == [P.READY, P.NODE_LOST]


def test_history_is_bounded() -> None:
    s = fresh()
    transition(s, P.STARTING, "t")
    for _ in range(MAX_HISTORY * 2):
        s.phase = P.STARTING
        transition(s, P.LOADING, "t")
    assert len(s.history) == MAX_HISTORY


def test_memo_carries_routing_fields() -> None:
    s = fresh()
    s.node_id, s.endpoint = "n1", "http://127.0.0.1:1"
    memo = memo_of(s)
    assert (memo.replica_id, memo.model, memo.node_id, memo.endpoint) == (
        "r1",
        "m",
        "n1",
        "http://127.0.0.1:1",
    )
