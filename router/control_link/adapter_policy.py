"""Which replica serves a LoRA adapter request, as a pure function.

On-demand adapters (vLLM's runtime LoRA API, ``max_loaded_adapters`` = N per
replica) make routing a cache problem:

1. a replica that holds the adapter serves it, while it is not saturated
   (the least loaded such replica);
2. otherwise one is chosen to load it: the least loaded replica with room
   (fewer than N adapters), else the least loaded one whose least recently
   used *idle* adapter can be unloaded to make room; an adapter with
   requests in flight is never unloaded;
3. when every candidate is saturated (or every adapter busy), no choice:
   the caller answers 503 or waits.

Naive affinity ("prefer the replica that has it", :func:`choose_naive`) is
kept for the benchmark: it sends every request for a hot adapter to the one
replica holding it, which saturates while the others idle.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Action(StrEnum):
    """What the chosen replica must do before serving."""

    USE = "use"
    LOAD = "load"
    EVICT_AND_LOAD = "evict_and_load"


@dataclass
class AdapterUse:
    """One adapter loaded on a replica."""

    last_used: float
    in_flight: int = 0


@dataclass
class ReplicaView:
    """What routing knows about a replica right now."""

    replica_id: str
    in_flight: int = 0
    cap: int = 0  # 0: no per-replica in-flight cap
    max_loaded: int = 1
    loaded: dict[str, AdapterUse] = field(default_factory=dict)

    @property
    def saturated(self) -> bool:
        """Whether the replica takes no new request."""
        return self.cap > 0 and self.in_flight >= self.cap


@dataclass(frozen=True)
class Choice:
    """Where to send a request, and what must happen first."""

    replica_id: str
    action: Action
    evict: str | None = None


def _idle_lru(replica: ReplicaView) -> str | None:
    idle = [(use.last_used, name) for name, use in replica.loaded.items() if use.in_flight == 0]
    return min(idle)[1] if idle else None


def choose(adapter: str, replicas: Sequence[ReplicaView]) -> Choice | None:
    """The replica for a request for ``adapter`` (None: all saturated or busy)."""
    open_ = [r for r in replicas if not r.saturated]
    holders = [r for r in open_ if adapter in r.loaded]
    if holders:
        best = min(holders, key=lambda r: (r.in_flight, r.replica_id))
        return Choice(best.replica_id, Action.USE)
    with_room = [r for r in open_ if len(r.loaded) < r.max_loaded]
    if with_room:
        best = min(with_room, key=lambda r: (r.in_flight, r.replica_id))
        return Choice(best.replica_id, Action.LOAD)
    evictable = [(r, victim) for r in open_ if (victim := _idle_lru(r)) is not None]
    if evictable:
        best, victim = min(evictable, key=lambda rv: (rv[0].in_flight, rv[0].replica_id))
        return Choice(best.replica_id, Action.EVICT_AND_LOAD, evict=victim)
    return None


def choose_naive(adapter: str, replicas: Sequence[ReplicaView]) -> Choice | None:
    """Prefer a replica that has the adapter, saturated or not (the benchmark's baseline)."""
    holders = [r for r in replicas if adapter in r.loaded]
    if holders:
        best = min(holders, key=lambda r: (r.in_flight, r.replica_id))
        return None if best.saturated else Choice(best.replica_id, Action.USE)
    target = min(replicas, key=lambda r: (r.in_flight, r.replica_id))
    if target.saturated:
        return None
    if len(target.loaded) < target.max_loaded:
        return Choice(target.replica_id, Action.LOAD)
    victim = _idle_lru(target)
    return Choice(target.replica_id, Action.EVICT_AND_LOAD, victim) if victim else None
