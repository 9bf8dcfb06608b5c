"""A deployment's slot book: which replicas it wants, as plain state.

The Deployment workflow owns the awaits (starting children, signalling
stops, asking loads); every decision about its slots is made here, without
Temporal, so that it can be driven through random sequences of failures,
scaling, model changes and rolling restarts in a test
(``tests/control/test_deployment_slots.py``) and shown to converge to the desired
count with no replica left unowned.

A slot is one desired replica across its restarts. Live slots count towards
``desired``; a surge slot (``replaces`` set) is the temporary extra of a
rolling restart; a retiring slot is draining and leaves the book when its
replica ends.
"""

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from llmgw.types import ReplicaPhase, ReplicaStatus, RestartPolicy, Slot
from workflows.deployment_rules import backoff_s, should_reap


class SlotEnd(StrEnum):
    """What a slot's replica ending led to."""

    RETIRED = "retired"
    PREEMPTED = "preempted"
    REAPED = "reaped"
    RESTART = "restart_scheduled"


@dataclass
class SlotBook:
    """Slots and their bookkeeping; ``active`` are slots whose replica runs."""

    desired: int
    slots: list[Slot]
    next_slot: int = 0
    rolling: list[int] = field(default_factory=list)
    retiring: set[int] = field(default_factory=set)
    active: set[int] = field(default_factory=set)
    # Runs from before the fix replaced a reaped slot with a new one.
    reaped_hold: bool = True
    # Runs from before the fix could surge for a slot already retiring and
    # left the surplus of a finished roll until the next change.
    converge: bool = True

    def live(self) -> list[Slot]:
        """Slots that count towards the desired number (not leaving or surging).

        A reaped slot keeps its place: replacing it with a new slot would
        restart the crash loop it was reaped for. A scale-down removes it
        first; a rolling restart (or a changed model) gives it a new chance.
        """
        return [
            s
            for s in self.slots
            if (self.reaped_hold or not s.reaped)
            and s.slot not in self.retiring
            and s.replaces is None
        ]

    def slot(self, number: int) -> Slot:
        """The slot numbered ``number``."""
        return next(s for s in self.slots if s.slot == number)

    def grow(self) -> None:
        """Add slots until the live ones reach the desired count."""
        while len(self.live()) < self.desired:
            self.slots.append(Slot(slot=self.next_slot))
            self.next_slot += 1

    def surplus(self) -> list[Slot]:
        """The live slots when there are more than desired (else none)."""
        live = self.live()
        return live if len(live) > self.desired else []

    def retire(self, slot: Slot) -> bool:
        """Mark ``slot`` as leaving; True when its replica must be told to stop.

        A slot with nothing running leaves the book at once.
        """
        if slot.slot in self.retiring:
            return False
        self.retiring.add(slot.slot)
        if slot.slot in self.active:
            return True
        # (Its number stays in ``retiring``, as it always has: numbers are
        # never reused, and the carry of older runs holds it.)
        self.slots.remove(slot)
        return False

    def begin_roll(self) -> None:
        """Every live slot is to be replaced, one at a time; reaped slots get a new chance."""
        for slot in self.slots:
            if slot.reaped:
                slot.reaped = False
                slot.consecutive_failures = 0
                slot.next_start_at = ""
        if not self.rolling:
            self.rolling = [s.slot for s in self.live() if s.replaces is None]

    def roll_step(self) -> Slot | None:
        """One step of a rolling restart: at most one surge slot at a time.

        Returns the slot to retire when a surge replica serves (its old slot).
        """
        surge = next((s for s in self.slots if s.replaces is not None), None)
        if surge is not None:
            if not surge.ready:
                return None
            old = next((s for s in self.slots if s.slot == surge.replaces), None)
            surge.replaces = None  # it counts as a regular slot from now on
            return old
        while self.rolling:
            number = self.rolling.pop(0)
            if self.converge and number in self.retiring:
                continue  # leaving anyway: replacing it would add a replica
            if any(s.slot == number and not s.reaped for s in self.slots):
                self.slots.append(Slot(slot=self.next_slot, replaces=number))
                self.next_slot += 1
                return None
        return None

    def due(self, now: datetime) -> list[Slot]:
        """Slots to start now: not reaped, nothing running, backoff over."""
        return [
            slot
            for slot in self.slots
            if not slot.reaped
            and slot.slot not in self.active
            and (not slot.next_start_at or datetime.fromisoformat(slot.next_start_at) <= now)
        ]

    def started(self, slot: Slot, replica_id: str) -> None:
        """A replica was started for ``slot``."""
        slot.replica_id = replica_id
        slot.starts += 1
        slot.next_start_at = ""
        slot.ready = False
        self.active.add(slot.slot)

    def ready(self, replica_id: str, node_id: str) -> None:
        """A replica serves (a rolling restart may now retire what it replaces)."""
        for slot in self.slots:
            if slot.replica_id == replica_id:
                slot.ready = True
                slot.node_id = node_id

    def ended(
        self,
        number: int,
        final: ReplicaStatus | None,
        error: str,
        now: datetime,
        policy: RestartPolicy,
    ) -> tuple[Slot, SlotEnd]:
        """Slot ``number``'s replica ended: drop the slot, or plan its restart."""
        slot = self.slot(number)
        self.active.discard(number)
        if number in self.retiring:
            self.retiring.discard(number)
            self.slots.remove(slot)
            return slot, SlotEnd.RETIRED
        slot.last_reason = error or (final.reason if final else "") or "ended"
        slot.last_log_tail = final.log_tail if final else []
        if final is not None and final.preempted_by:
            # Made room for a more important model: not a failure of ours.
            # The replacement waits in placement until room frees up.
            slot.preempted_by = final.preempted_by
            slot.next_start_at = (now + timedelta(seconds=policy.initial_backoff_s)).isoformat()
            return slot, SlotEnd.PREEMPTED
        served = final is not None and any(h.phase is ReplicaPhase.READY for h in final.history)
        if served:
            slot.consecutive_failures = 0  # it worked for a while: not a crash loop
        slot.consecutive_failures += 1
        if should_reap(slot, policy):
            slot.reaped = True
            return slot, SlotEnd.REAPED
        delay = backoff_s(slot.consecutive_failures, policy)
        slot.next_start_at = (now + timedelta(seconds=delay)).isoformat()
        return slot, SlotEnd.RESTART
