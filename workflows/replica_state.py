"""Replica lifecycle rules, as pure functions the workflow applies."""

from llmgw.errors import LlmgwError
from llmgw.types import (
    ROUTABLE_PHASES,
    TERMINAL_PHASES,
    PhaseChange,
    ReplicaMemo,
    ReplicaPhase,
    ReplicaStatus,
)

P = ReplicaPhase

ALLOWED: dict[ReplicaPhase, frozenset[ReplicaPhase]] = {
    # placing -> placing records a step of a long placement (a preemption).
    P.PLACING: frozenset({P.PLACING, P.FETCHING, P.STARTING, P.STOPPED, P.FAILED}),
    P.FETCHING: frozenset({P.STARTING, P.STOPPING, P.FAILED}),
    P.STARTING: frozenset({P.LOADING, P.DRAINING, P.STOPPING, P.FAILED}),
    P.LOADING: frozenset({P.READY, P.DRAINING, P.STOPPING, P.FAILED}),
    P.READY: frozenset({P.NODE_LOST, P.DRAINING, P.STOPPING, P.FAILED}),
    P.NODE_LOST: frozenset({P.READY, P.DRAINING, P.STOPPING, P.FAILED}),
    P.DRAINING: frozenset({P.STOPPING, P.FAILED}),
    P.STOPPING: frozenset({P.STOPPED, P.FAILED}),
    P.STOPPED: frozenset(),
    P.FAILED: frozenset(),
}

MAX_HISTORY = 50


class IllegalTransition(LlmgwError, ValueError):
    """A phase change the lifecycle does not allow: a bug, never user input."""


def transition(status: ReplicaStatus, phase: ReplicaPhase, at: str, detail: str = "") -> None:
    """Move ``status`` to ``phase``, recording when and why."""
    if phase not in ALLOWED[status.phase]:
        raise IllegalTransition(f"{status.replica_id}: {status.phase} -> {phase}")
    status.phase = phase
    status.history.append(PhaseChange(phase=phase, at=at, detail=detail))
    # Bounded: the status travels in every query answer.
    del status.history[:-MAX_HISTORY]


def is_terminal(phase: ReplicaPhase) -> bool:
    """Whether nothing further happens to a replica in ``phase``."""
    return phase in TERMINAL_PHASES


def routable(phase: ReplicaPhase) -> bool:
    """Whether the router may send new requests to a replica in ``phase``."""
    return phase in ROUTABLE_PHASES


def memo_of(status: ReplicaStatus) -> ReplicaMemo:
    """The part of the status the router reads off the memo."""
    return ReplicaMemo(
        replica_id=status.replica_id,
        model=status.model,
        phase=status.phase,
        node_id=status.node_id,
        endpoint=status.endpoint,
        adapters=status.adapters,
    )


def note(status: ReplicaStatus, at: str, detail: str) -> None:
    """Record something that happened without a change of phase."""
    status.history.append(PhaseChange(phase=status.phase, at=at, detail=detail))
    del status.history[:-MAX_HISTORY]
