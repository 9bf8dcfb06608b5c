"""The autoscaler's decisions over recorded load traces, without Temporal.

A trace is what routers reported, second by second; the tests replay it
through the load book as the Deployment workflow does (a report, then a
decision; the timer's checks in between) and look at the counts it chose.
"""

from collections.abc import Iterable
from itertools import pairwise

import pytest

from llmgw.types import AutoscalePolicy, ElasticState, LoadReport, LoadSample, ModelLoad
from workflows.autoscale import (
    Clock,
    average_need,
    decide,
    need_at,
    next_check,
    peak_need,
    prune,
)
from workflows.deployment_load import KEEP_DECISIONS, LoadBook, wake_outcome
from workflows.deployment_slots import SlotBook

T0 = 1_800_000_000.0
POLICY = AutoscalePolicy(
    min_replicas=1,
    max_replicas=4,
    target_inflight=4,
    scale_up_window_s=10,
    scale_down_window_s=60,
    idle_timeout_s=300,
)


def report(router: str, inflight: int, waiting: int = 0, arrivals: int | None = None) -> LoadReport:
    busy = inflight + waiting
    return LoadReport(
        router_id=router,
        load=ModelLoad(
            model="m", inflight=inflight, waiting=waiting,
            arrivals=busy if arrivals is None else arrivals,
        ),
    )  # fmt: skip


class Run:
    """A deployment's load book driven the way the workflow drives it."""

    def __init__(self, policy: AutoscalePolicy, desired: int) -> None:
        self.book = LoadBook(ElasticState())
        self.book.set_policy(policy, T0)
        self.desired = desired
        self.counts: list[tuple[float, int]] = []

    def step(self, now: float, reports: Iterable[LoadReport] = ()) -> int:
        for r in reports:
            self.book.report(r, now)
        choice = self.book.evaluate(self.desired, now)
        if choice is not None:
            self.book.record(self.desired, choice.desired, choice.reason, now)
            self.desired = choice.desired
            self.counts.append((now, self.desired))
        return self.desired

    def play(self, trace: dict[int, list[LoadReport]], until: int) -> None:
        """One report round a second from ``trace`` (second -> reports),
        and the timer's checks whenever it would fire between them."""
        for second in range(until):
            now = T0 + second
            self.step(now, trace.get(second, []))
            due = self.book.next_check(self.desired, now)
            while due is not None and due < now + 1:
                self.step(due)
                due = self.book.next_check(self.desired, due)


def test_the_sum_holds_each_routers_last_report_until_it_expires() -> None:
    samples = [
        LoadSample(at=T0, router_id="a", inflight=4),
        LoadSample(at=T0 + 1, router_id="b", inflight=2, waiting=1),
        LoadSample(at=T0 + 2, router_id="a", inflight=6),
    ]
    assert need_at(samples, T0 + 0.5) == 4
    assert need_at(samples, T0 + 1.5) == 7
    assert need_at(samples, T0 + 2) == 9
    # b is silent past the expiry (5 s after its report), a still counts.
    assert need_at(samples, T0 + 6.5) == 6
    assert need_at(samples, T0 + 7.5) == 0
    # Time-weighted: 4 for 1 s, 7 for 1 s, 9 for 2 s -> 29 / 4.
    assert average_need(samples, T0, T0 + 4) == pytest.approx(29 / 4)
    assert peak_need(samples, T0, T0 + 4) == 9


def test_a_burst_scales_up_after_its_average_and_down_only_after_the_window() -> None:
    run = Run(POLICY, desired=1)
    # 12 in flight for 30 s, then nothing (one final zero report).
    trace = {s: [report("r1", 12)] for s in range(30)}
    trace[30] = [report("r1", 0, arrivals=0)]
    run.play(trace, until=200)
    ups = [(int(t - T0), n) for t, n in run.counts if n > 1]
    assert ups[0][1] >= 2 and max(n for _, n in run.counts) == 3
    # Never above what 12 in flight needs at 4 each, and back to 1 once the
    # down window (60 s) saw no load: not one step earlier.
    assert run.counts[-1][1] == 1
    down_at = run.counts[-1][0] - T0
    assert down_at >= 30 + POLICY.scale_down_window_s
    reasons = [d.reason for d in run.book.state.decisions]
    assert "scale 1 -> " in reasons[0] and "in flight per replica over" in reasons[0]
    assert "target 4" in reasons[0]
    assert reasons[-1].startswith("scale 3 -> 1: at most 0.0 in flight per replica over 60 s")


def test_the_reason_names_the_average_per_replica_and_the_window() -> None:
    book = LoadBook(ElasticState())
    book.set_policy(POLICY, T0 - 100)
    for second in range(11):
        book.report(report("r", 11), T0 + second)
    choice = book.evaluate(1, T0 + 10)
    assert choice is not None and choice.desired == 3
    assert choice.reason == "scale 1 -> 3: 11.0 in flight per replica over 10 s, target 4"


def test_flapping_load_scales_up_once_and_does_not_flap_down() -> None:
    run = Run(POLICY, desired=1)
    # 16 in flight for 5 s, then 2 for 5 s, over and over for 3 minutes.
    trace = {s: [report("r", 16 if (s // 5) % 2 == 0 else 2)] for s in range(180)}
    run.play(trace, until=180)
    counts = [n for _, n in run.counts]
    downs = [n for before, n in pairwise(counts) if n < before]
    assert downs == []  # every down window held a peak
    assert run.desired >= 2
    assert len(run.counts) <= 3  # a couple of steps up, no oscillation


def test_several_routers_are_summed_and_a_silent_one_expires() -> None:
    run = Run(POLICY.model_copy(update={"scale_down_window_s": 20}), desired=1)
    # Two routers with 6 each for 20 s: 12 -> 3 replicas. Then r2 dies
    # without a final report; r1 keeps reporting 6 (2 replicas).
    trace = {s: [report("r1", 6), report("r2", 6)] for s in range(20)}
    for s in range(20, 120):
        trace[s] = [report("r1", 6)]
    run.play(trace, until=120)
    assert max(n for _, n in run.counts) == 3
    assert run.desired == 2
    assert run.book.summary(T0 + 119).routers == 1


def test_a_silent_router_with_load_stops_counting_even_without_reports() -> None:
    # The only router crashes holding 16 requests: its report expires on the
    # timer alone, and the down window runs out on the timer alone.
    run = Run(POLICY.model_copy(update={"scale_down_window_s": 20}), desired=1)
    run.play({s: [report("r", 16)] for s in range(12)}, until=12)
    assert run.desired == 4
    now = T0 + 11
    while (due := run.book.next_check(run.desired, now)) is not None and run.desired > 1:
        now = due
        run.step(now)
    assert run.desired == 1
    assert now - (T0 + 11) == pytest.approx(POLICY.idle_timeout_s * 0 + 5 + 20, abs=0.01)


def test_idle_scales_to_zero_and_load_brings_it_back() -> None:
    policy = POLICY.model_copy(update={"min_replicas": 0, "idle_timeout_s": 30})
    run = Run(policy, desired=1)
    run.play({0: [report("r", 1)], 1: [report("r", 0, arrivals=0)]}, until=40)
    assert run.desired == 0
    zero_at, _ = run.counts[-1]
    assert zero_at - T0 == pytest.approx(30, abs=0.01)  # on the timer, not a second late
    assert "no request for 30 s (idle timeout 30 s)" in run.book.state.decisions[-1].reason
    # At zero nothing changes without load...
    assert run.book.next_check(0, T0 + 100) is None
    assert run.step(T0 + 100) == 0
    # ...and a router holding requests brings one back.
    assert run.step(T0 + 101, [report("r", 0, waiting=3)]) == 1
    assert run.book.state.decisions[-1].reason == "scale 0 -> 1: 3 requests while scaled to zero"


def test_no_idle_timeout_while_a_replica_is_starting() -> None:
    policy = POLICY.model_copy(update={"min_replicas": 0, "idle_timeout_s": 30})
    book = LoadBook(ElasticState())
    book.set_policy(policy, T0)
    assert book.evaluate(1, T0 + 100, starting=True) is None
    assert book.next_check(1, T0 + 100, starting=True) is None
    book.touch(T0 + 100)  # it serves now (the ready notice)
    assert book.evaluate(1, T0 + 129) is None
    assert book.next_check(1, T0 + 129) == T0 + 130


def test_zero_min_stays_at_one_while_requests_come_in() -> None:
    policy = POLICY.model_copy(update={"min_replicas": 0, "idle_timeout_s": 30})
    run = Run(policy, desired=1)
    trace = {s: [report("r", 0, arrivals=1)] for s in range(0, 100, 10)}
    run.play(trace, until=100)
    assert run.counts == []


def test_bounds_clamp_and_a_changed_policy_applies_at_once() -> None:
    clock = Clock(now=T0, last_activity=T0, last_change=T0)
    loaded = [LoadSample(at=T0 - 10, router_id="r", inflight=100)]
    assert decide(POLICY, loaded, 1, clock).desired == 4  # max
    narrower = POLICY.model_copy(update={"max_replicas": 2})
    choice = decide(narrower, [], 4, clock)
    assert (choice.desired, choice.reason) == (2, "scale 4 -> 2: above max_replicas 2")
    wider = POLICY.model_copy(update={"min_replicas": 3})
    assert decide(wider, [], 1, clock).desired == 3
    assert decide(POLICY, [], 1, clock).reason == ""


def test_a_policy_the_first_run_started_with_counts_its_windows_from_then() -> None:
    book = LoadBook(ElasticState(policy=POLICY.model_copy(update={"min_replicas": 0})))
    assert book.evaluate(1, T0) is None  # not idle since the epoch
    assert book.state.last_activity == T0 and book.state.last_change == T0
    choice = book.evaluate(1, T0 + 300)
    assert choice is not None and choice.desired == 0


def test_no_timer_while_nothing_can_change() -> None:
    clock = Clock(now=T0, last_activity=T0, last_change=T0 - 1000)
    assert next_check(POLICY, [], 1, clock) is None  # at min, no idle timeout (min 1)


def test_samples_and_decisions_are_bounded() -> None:
    book = LoadBook(ElasticState())
    book.set_policy(POLICY, T0)
    for second in range(100):
        for router in range(20):
            book.report(report(f"r{router}", second % 7), T0 + second)
    samples = book.state.samples
    assert len({s.router_id for s in samples}) == 16
    assert all(T0 + 99 - s.at <= 60 + 5 for s in samples)
    assert len(prune(samples, None, T0 + 99)) == 16 * 6
    for n in range(50):
        book.record(n, n + 1, "x", T0 + n)
    assert len(book.state.decisions) == KEEP_DECISIONS


def test_a_wake_answers_ready_failed_or_not_yet() -> None:
    from llmgw.types import Slot  # noqa: PLC0415

    book = SlotBook(desired=1, slots=[Slot(slot=0, replica_id="m-1")], active={0})
    assert wake_outcome(book, "m", "") is None
    assert wake_outcome(book, "m", "replica m-1 ended: cannot place") == (
        False,
        "replica m-1 ended: cannot place",
    )
    book.ready("m-1", "n")
    assert wake_outcome(book, "m", "") == (True, "")
    book.desired = 0
    book.slots[0].ready = False
    assert wake_outcome(book, "m", "") == (False, "m was scaled to zero meanwhile")
