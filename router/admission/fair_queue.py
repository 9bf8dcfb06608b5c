"""The order in which a model's waiting requests are served: a pure structure.

Priority classes first (``high`` before ``normal`` before ``batch``, strictly:
a batch request waits while any other does). Within a class, weighted fair
queuing on tokens, self-clocked (SCFQ): a request's virtual finish time is
``max(V, the finish of its key's previous request) + cost / weight``, where
``V`` is the finish time of the request served last in that class; the
smallest finish is served next. A key that floods the queue pushes only its
own finish times out, so a light key's request overtakes its backlog: each
key gets a share of the served tokens proportional to its weight, whatever
the others send. Ties go to the earlier arrival.

A request taken out before it is served (its client left, its wait ran
out) stays in its class's heap, marked, until popped; once such entries
outnumber the live ones the heap is rebuilt without them, so a class that
never empties (one request always waiting while others join and leave)
holds O(live) entries, not one per request ever queued.

No clock and no asyncio here: the admission layer (router/admission/queue.py)
pops entries and wakes their requests.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from llmgw.types import Priority

T = TypeVar("T")

# Served strictly in this order.
PRIORITY_ORDER = (Priority.HIGH, Priority.NORMAL, Priority.BATCH)
# A heap is compacted only past this many dead entries (small heaps are cheap).
COMPACT_MIN_DEAD = 64


@dataclass(eq=False)
class Entry(Generic[T]):
    """One waiting request; ``item`` is the caller's (the admission layer's ticket)."""

    item: T
    key: int
    priority: Priority
    cost: float
    weight: float
    finish: float = 0.0
    seq: int = 0
    removed: bool = False


@dataclass
class _Class(Generic[T]):
    """One priority class: a heap of entries by (finish, arrival)."""

    heap: list[tuple[float, int, Entry[T]]] = field(default_factory=list)
    # The virtual time: the finish of the entry served last.
    now: float = 0.0
    # Each key's latest finish time (dropped once the class empties).
    last: dict[int, float] = field(default_factory=dict)
    size: int = 0  # live entries
    dead: int = 0  # removed entries still in the heap


class FairQueue(Generic[T]):
    """Waiting requests of one model, served by priority, then fairly by tokens."""

    def __init__(self) -> None:
        self._classes: dict[Priority, _Class[T]] = {p: _Class() for p in PRIORITY_ORDER}
        self._seq = itertools.count()
        self._per_key: dict[int, int] = {}  # live entries per key, all classes

    def __len__(self) -> int:
        return sum(c.size for c in self._classes.values())

    def push(
        self,
        item: T,
        key: int,
        cost: float,
        weight: float = 1.0,
        priority: Priority = Priority.NORMAL,
    ) -> Entry[T]:
        """Queue ``item`` for ``key``; ``cost`` in tokens (at least 1), ``weight`` > 0."""
        if weight <= 0:
            raise ValueError("weight must be positive")
        c = self._classes[priority]
        start = max(c.now, c.last.get(key, 0.0))
        entry = Entry(item, key, priority, max(cost, 1.0), weight, seq=next(self._seq))
        entry.finish = start + entry.cost / weight
        c.last[key] = entry.finish
        heapq.heappush(c.heap, (entry.finish, entry.seq, entry))
        c.size += 1
        self._per_key[key] = self._per_key.get(key, 0) + 1
        return entry

    def pop(self) -> Entry[T] | None:
        """The next entry to serve, or None when nothing waits."""
        for priority in PRIORITY_ORDER:
            c = self._classes[priority]
            while c.heap:
                _, _, entry = heapq.heappop(c.heap)
                if entry.removed:
                    c.dead -= 1
                    continue
                entry.removed = True
                c.size -= 1
                self._left(entry.key)
                c.now = max(c.now, entry.finish)
                if c.size == 0:
                    self._reset(c)
                return entry
        return None

    def remove(self, entry: Entry[T]) -> bool:
        """Take a waiting entry out (its client left or its wait ran out);
        False when it was served or removed already."""
        if entry.removed:
            return False
        entry.removed = True
        c = self._classes[entry.priority]
        c.size -= 1
        c.dead += 1
        self._left(entry.key)
        if c.size == 0:
            self._reset(c)
        elif c.dead > c.size and c.dead >= COMPACT_MIN_DEAD:
            self._compact(c)
        return True

    def items(self) -> list[T]:
        """Every waiting item, in no particular order."""
        return [e.item for c in self._classes.values() for _, _, e in c.heap if not e.removed]

    def depth(self, priority: Priority) -> int:
        """How many wait in one class."""
        return self._classes[priority].size

    def waiting_of(self, key: int) -> int:
        """How many of ``key``'s requests wait, in every class."""
        return self._per_key.get(key, 0)

    def heap_len(self) -> int:
        """Entries held in the heaps, dead ones included (bounded: ``_compact``)."""
        return sum(len(c.heap) for c in self._classes.values())

    def _left(self, key: int) -> None:
        n = self._per_key[key] - 1
        if n:
            self._per_key[key] = n
        else:
            del self._per_key[key]

    @staticmethod
    def _compact(c: _Class[T]) -> None:
        # Rebuilt once the dead outnumber the live: O(n) now and then, so
        # amortised O(1) per removal, and the heap stays within twice the live.
        c.heap = [t for t in c.heap if not t[2].removed]
        heapq.heapify(c.heap)
        c.dead = 0
        # A key whose last finish is behind the virtual time starts at the
        # virtual time anyway: its entry says nothing (keys that came and went).
        c.last = {k: f for k, f in c.last.items() if f > c.now}

    @staticmethod
    def _reset(c: _Class[T]) -> None:
        # An empty class forgets its history: a key idle until now starts
        # level with everyone (no credit, no debt), and the numbers stay small.
        c.heap.clear()
        c.last.clear()
        c.now = 0.0
        c.dead = 0
