"""What a replica's lifecycle gives the path that serves it, and gets back.

A replica serves on one node (``workflows/replica_one_node.py``) or as
ranks on several (``workflows/replica_ranks.py``). Everything else - placing,
preempting, stopping, draining, failing, releasing, publishing its phase -
is one lifecycle, ``workflows/replica.py``, shared by both. A path starts
and watches the engine and stops it; it moves the replica's phase through
the lifecycle's ``move`` and awaits through its ``interruptible``, so a stop
request ends any wait. Workflow code: deterministic.
"""

from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, TypeVar

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw.types import Placement, ReplicaInput, ReplicaPhase, ReplicaStatus

T = TypeVar("T")
# The watch activity lives as long as the engine; its heartbeats, not this
# bound, are what notice a dead agent.
WATCH_LIFETIME = timedelta(days=3650)


class Move(Protocol):
    """The lifecycle's phase change: recorded, logged, published."""

    def __call__(self, phase: ReplicaPhase, detail: str = "", /) -> None: ...


class Interruptible(Protocol):
    """Await something unless a stop request arrives first (then it raises)."""

    def __call__(self, aw: Awaitable[T], /) -> Awaitable[T]: ...


@dataclass(frozen=True)
class ServingEnded:
    """Why serving ended on its own: the replica fails with ``reason``."""

    reason: str
    # The engine is gone already: nothing is left to stop.
    engine_gone: bool = False
    # The node found lost, when that is why (the fleet offers it to no one
    # until its agent registers again).
    node_lost: str = ""


class ServingPath:
    """What both paths are given; each starts, watches and stops its engine its own way."""

    def __init__(
        self,
        input: ReplicaInput,
        status: ReplicaStatus,
        placement: Placement,
        move: Move,
        interruptible: Interruptible,
        *,
        fetches: bool,
    ) -> None:
        """``fetches``: the history has the weights-fetch step (older ones start without)."""
        self._input = input
        self._t = input.timeouts
        self._status = status
        self._placement = placement
        self._move = move
        self._interruptible = interruptible
        self._fetches = fetches
        # Whether an engine may be running: what a stop has to stop.
        self.launched = False

    async def serve(self) -> ServingEnded:
        """Start the engine and watch it until it exits (a stop request raises)."""
        raise NotImplementedError

    async def keep_log_tail(self) -> None:
        """On a failure, keep what the engine last wrote if the path has a way to."""

    async def stop(self) -> None:
        """Stop what was launched; a failed stop is added to the replica's reason."""
        raise NotImplementedError
