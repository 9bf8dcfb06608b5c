"""A deployment's load book: the routers' reports and its scaling decisions.

Plain state, no Temporal: the Deployment workflow feeds it reports and asks
it what the load calls for (workflows/autoscale.py decides); the book keeps
only what the windows need and the last decisions, and is carried through
continue-as-new whole (:class:`ElasticState`), samples included, so that a
new run keeps the down window's stabilisation.
"""

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime

from llmgw.types import (
    AutoscalePolicy,
    ElasticState,
    LoadReport,
    LoadSample,
    LoadSummary,
    ScaleDecision,
)
from workflows.autoscale import Choice, Clock, decide, load_at, next_check, prune
from workflows.deployment_slots import SlotBook

# Decisions kept for `llmgw explain` and the status query.
KEEP_DECISIONS = 20


@dataclass
class LoadBook:
    """The autoscaling state of one deployment."""

    state: ElasticState

    @property
    def policy(self) -> AutoscalePolicy | None:
        """The bounds the count follows the load within; None: a fixed count."""
        return self.state.policy

    def set_policy(self, policy: AutoscalePolicy | None, now: float) -> None:
        """Follow the load within ``policy`` from now on (None: stop following)."""
        self.state.policy = policy
        if policy is not None:
            # Freshly set: no idle timeout or down step before their windows ran.
            self.state.last_activity = self.state.last_activity or now
            self.state.last_change = self.state.last_change or now

    def report(self, report: LoadReport, now: float) -> None:
        """Keep a router's report (stamped with workflow time: routers' clocks differ)."""
        load = report.load
        sample = LoadSample(
            at=now,
            router_id=report.router_id,
            inflight=load.inflight,
            waiting=load.waiting,
            arrivals=load.arrivals,
        )
        if load.inflight or load.waiting or load.arrivals:
            self.state.last_activity = now
        self.state.samples = prune([*self.state.samples, sample], self.policy, now)

    def touch(self, now: float) -> None:
        """A request was seen (a wake): the idle timeout starts again."""
        self.state.last_activity = now

    def clock(self, now: float, starting: bool = False) -> Clock:
        s = self.state
        return Clock(now, s.last_activity, s.last_change, starting)

    def evaluate(self, desired: int, now: float, starting: bool = False) -> Choice | None:
        """A new desired count if the load calls for one (None: keep it, or no policy)."""
        if self.policy is None:
            return None
        # A policy from the model a first run started with: its windows start now.
        self.set_policy(self.policy, now)
        self.state.samples = prune(self.state.samples, self.policy, now)
        choice = decide(self.policy, self.state.samples, desired, self.clock(now, starting))
        return choice if choice.desired != desired else None

    def next_check(self, desired: int, now: float, starting: bool = False) -> float | None:
        """When to look again though no report arrives (None: only on a report)."""
        if self.policy is None:
            return None
        return next_check(self.policy, self.state.samples, desired, self.clock(now, starting))

    def record(self, before: int, after: int, reason: str, now: float) -> ScaleDecision:
        """Keep a change of the desired count with its reason."""
        made = ScaleDecision(
            at=datetime.fromtimestamp(now, UTC).isoformat(),
            from_replicas=before,
            to_replicas=after,
            reason=reason,
        )
        self.state.decisions = [*self.state.decisions, made][-KEEP_DECISIONS:]
        self.state.last_change = now
        return made

    def summary(self, now: float) -> LoadSummary:
        """The load in force now, summed over the routers still reporting."""
        live = load_at(self.state.samples, now)
        return LoadSummary(
            inflight=sum(s.inflight for s in live),
            waiting=sum(s.waiting for s in live),
            routers=len(live),
        )


def wake_outcome(book: SlotBook, model: str, failed: str) -> tuple[bool, str] | None:
    """A wake's answer: a replica serves, or why none will (None: not yet).

    ``failed`` is the reason a replica ended since the wake began (empty:
    none did): the first failed start answers the wake, though the slot
    is restarted after its backoff as usual.
    """
    live = book.live()
    if any(s.ready and s.slot in book.active for s in live):
        return True, ""
    if book.desired == 0:
        return False, f"{model} was scaled to zero meanwhile"
    if failed:
        return False, failed
    if live and all(s.reaped for s in live):
        return False, f"gave up restarting: {live[0].last_reason}"
    return None


@dataclass
class DueTimer:
    """The deployment's one autoscale timer (idle timeout, down window, a
    silent router's report expiring), kept across waits: each new timer is
    two more history events. A moment that moves later (every report moves
    its router's expiry) keeps the timer; it fires early, the deployment
    looks, and arms the next. Only an earlier moment replaces it."""

    future: "asyncio.Future[None] | None" = None
    at: float = 0.0

    def arm(self, due: float | None, now: float) -> "asyncio.Future[None] | None":
        """The timer to wait on for ``due`` (None: nothing pending)."""
        pending = self.future is not None and not self.future.done()
        if due is not None and (not pending or due < self.at):
            if pending and self.future is not None:
                self.future.cancel()
            # In the workflow, asyncio.sleep is a durable Temporal timer.
            self.future = asyncio.ensure_future(asyncio.sleep(due - now))
            self.at = due
        return self.future if self.future is not None and not self.future.done() else None
