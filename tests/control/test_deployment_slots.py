"""The deployment's slot book driven without Temporal: the sequence that left
a deployment of 1 with two ready replicas, and random sequences of
failures, scaling, model changes and rolling restarts, after which the book
must settle on exactly the desired count with no replica unowned."""

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.types import PhaseChange, ReplicaPhase, ReplicaStatus, RestartPolicy, Slot
from workflows.deployment_rules import slots_to_retire
from workflows.deployment_slots import SlotBook

POLICY = RestartPolicy(initial_backoff_s=2, max_backoff_s=300, max_consecutive_failures=5)


@dataclass
class World:
    """What runs, as the deployment workflow would see it: replica -> slot."""

    book: SlotBook
    converge: bool = True
    now: datetime = field(default_factory=lambda: datetime(2026, 1, 1, tzinfo=UTC))
    running: dict[str, int] = field(default_factory=dict)
    ready: set[str] = field(default_factory=set)
    stopping: set[str] = field(default_factory=set)
    started: int = 0

    def reconcile(self) -> None:
        """The workflow's reconcile pass, in its order, with its awaits done at once."""
        book = self.book
        book.grow()
        self._scale_down()
        old = book.roll_step()
        if old is not None:
            self._retire(old)
        if book.converge:
            self._scale_down()
        for slot in book.due(self.now):
            self.started += 1
            rid = f"r{self.started}"
            book.started(slot, rid)
            self.running[rid] = slot.slot

    def _scale_down(self) -> None:
        live = self.book.surplus()
        if live:
            for slot in slots_to_retire(live, self.book.desired, {}):
                self._retire(slot)

    def _retire(self, slot: Slot) -> None:
        if slot.slot in self.book.retiring:
            return
        if self.book.retire(slot):
            self.stopping.add(slot.replica_id)

    def serve(self, rid: str) -> None:
        """A replica became ready."""
        self.ready.add(rid)
        self.book.ready(rid, "n1")

    def end(self, rid: str, *, served: bool) -> None:
        """A replica ended (failed, or stopped on request)."""
        number = self.running.pop(rid)
        self.ready.discard(rid)
        self.stopping.discard(rid)
        history = [PhaseChange(phase=ReplicaPhase.READY, at="")] if served else []
        final = ReplicaStatus(
            replica_id=rid, model="m", phase=ReplicaPhase.FAILED, reason="x", history=history
        )
        self.book.ended(number, final, "", self.now, POLICY)

    def wait(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def settle(self) -> None:
        """No more faults: stops finish, starts succeed, backoffs pass."""
        for _ in range(50):
            self.reconcile()
            for rid in sorted(self.stopping):
                self.end(rid, served=rid in self.ready)
            for rid in sorted(set(self.running) - self.ready):
                self.serve(rid)
            self.wait(400)
            self.reconcile()
            quiet = not self.stopping and set(self.running) <= self.ready
            if quiet and not self.book.rolling and self._no_surge():
                return
        raise AssertionError(f"never settled: {self.book}")

    def _no_surge(self) -> bool:
        return all(s.replaces is None for s in self.book.slots)


def _book(desired: int, *, converge: bool = True) -> SlotBook:
    return SlotBook(desired=desired, slots=[], converge=converge)


def _assert_converged(world: World) -> None:
    book = world.book
    owned = {s.replica_id: s.slot for s in book.slots if s.slot in book.active}
    # No replica runs that its slot does not own, and no slot claims one that is gone.
    assert owned == world.running
    reaped = [s for s in book.live() if s.reaped]
    assert len(world.running) + len(reaped) == book.desired
    assert len(book.live()) == book.desired
    assert not book.retiring & book.active


def _bad_then_good_update(converge: bool) -> World:
    world = World(_book(1, converge=converge))
    world.reconcile()
    world.serve("r1")
    world.book.begin_roll()  # the catalog entry changed: to an unplaceable one
    world.reconcile()
    assert set(world.running) == {"r1", "r2"}
    world.end("r2", served=False)  # cannot place
    world.reconcile()
    world.book.begin_roll()  # fixed in the catalog while r2's slot backs off
    world.reconcile()
    world.wait(10)
    world.reconcile()
    world.serve("r3")
    world.reconcile()  # r3 serves: r1 is retired
    assert world.stopping == {"r1"}
    world.reconcile()  # any change while r1 drains (a late notice, a timer)
    world.end("r1", served=True)
    world.reconcile()
    for rid in sorted(set(world.running) - world.ready):
        world.serve(rid)
        world.reconcile()  # its ready notice: the last change there is
    return world


def test_bad_then_good_catalog_update_keeps_the_desired_count() -> None:
    world = _bad_then_good_update(converge=True)
    assert sorted(world.running) == ["r3"]
    _assert_converged(world)


def test_the_old_rule_kept_a_surplus_replica() -> None:
    # What was seen: deployment `tiny` (desired 1), both slots ready for minutes.
    world = _bad_then_good_update(converge=False)
    assert len(world.running) == 2 and world.running.keys() <= world.ready


EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("fail"), st.integers(0, 5)),
        st.tuples(st.just("ready"), st.integers(0, 5)),
        st.tuples(st.just("stopped"), st.integers(0, 5)),
        st.tuples(st.just("scale"), st.integers(0, 4)),
        st.tuples(st.just("roll"), st.just(0)),
        st.tuples(st.just("wait"), st.integers(1, 400)),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(initial=st.integers(0, 3), events=EVENTS)
def test_any_sequence_converges_to_the_desired_count(
    initial: int, events: list[tuple[str, int]]
) -> None:
    world = World(_book(initial))
    world.reconcile()
    for kind, arg in events:
        running = sorted(world.running)
        if kind == "fail" and running:
            rid = running[arg % len(running)]
            world.end(rid, served=rid in world.ready)
        elif kind == "ready":
            waiting = sorted(set(running) - world.ready)
            if waiting:
                world.serve(waiting[arg % len(waiting)])
        elif kind == "stopped" and world.stopping:
            stopping = sorted(world.stopping)
            rid = stopping[arg % len(stopping)]
            world.end(rid, served=rid in world.ready)
        elif kind == "scale":
            world.book.desired = arg
        elif kind == "roll":
            world.book.begin_roll()
        elif kind == "wait":
            world.wait(arg)
        world.reconcile()
        # Surges are bounded: never more than one replica above the live slots.
        surging = [s for s in world.book.slots if s.replaces is not None]
        assert len(surging) <= 1
    world.settle()
    _assert_converged(world)
