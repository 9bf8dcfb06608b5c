"""The autoscaler's decision, as pure functions over the routers' load reports.

Each router reports a model's load (requests in flight and waiting) at most
once a second while it has any, and once more when it has none. A router's
latest report holds until its next one or until it expires (a router that
stopped reporting, crashed or partitioned, no longer counts); the
deployment's load at any moment is the sum over the routers. That makes the
load a step function of time, and the windows are exact over it:

- **up**: the time-weighted average need (in flight + waiting) over
  ``scale_up_window_s``, divided by ``target_inflight``, rounded up;
- **down**: only to what the *highest* need over ``scale_down_window_s``
  asks for, and not before that long since the last change (stabilisation:
  a load that dips and comes back does not flap the count);
- **to zero**: ``min_replicas`` 0 and no request for ``idle_timeout_s``.
  At zero, the count rises again only on load (a report, or a wake).

Tested without Temporal over recorded traces in tests/control/test_autoscale.py.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from llmgw.types import AutoscalePolicy, LoadSample

# A router that has not reported for this long no longer counts.
EXPIRE_S = 5.0
# A ratio this close above a whole number does not ask for one more replica
# (float noise in the averages).
_EPSILON = 1e-9


@dataclass(frozen=True)
class Choice:
    """The desired count the load asks for, and why (no reason: unchanged)."""

    desired: int
    reason: str = ""


@dataclass(frozen=True)
class Clock:
    """When things last happened (workflow time, seconds since the epoch)."""

    now: float
    last_activity: float
    last_change: float
    # A replica is starting: idle time counts from when it serves (a slow
    # load must not look like an idle model).
    starting: bool = False


def _need(sample: LoadSample) -> int:
    return sample.inflight + sample.waiting


def load_at(
    samples: Iterable[LoadSample], t: float, expire_s: float = EXPIRE_S
) -> list[LoadSample]:
    """Each router's report in force at ``t`` (its latest not after ``t``, not expired)."""
    latest: dict[str, LoadSample] = {}
    for sample in samples:
        if sample.at <= t:
            seen = latest.get(sample.router_id)
            if seen is None or sample.at >= seen.at:
                latest[sample.router_id] = sample
    return [s for s in latest.values() if t - s.at < expire_s]


def need_at(samples: Sequence[LoadSample], t: float, expire_s: float = EXPIRE_S) -> int:
    """Requests in flight and waiting at ``t``, summed over the routers."""
    return sum(_need(s) for s in load_at(samples, t, expire_s))


def steps(
    samples: Sequence[LoadSample], start: float, end: float, expire_s: float = EXPIRE_S
) -> list[tuple[float, int]]:
    """The summed need as a step function over [start, end]: ``(t, need)``
    from ``t`` until the next step; the last step starts at ``end`` (reports
    arriving right then). One sweep over reports and expiries."""
    events: list[tuple[float, int, LoadSample]] = []
    for sample in samples:
        events.append((sample.at + expire_s, 0, sample))  # expiries first at a tie
        events.append((sample.at, 1, sample))
    events.sort(key=lambda e: (e[0], e[1]))
    current: dict[str, LoadSample] = {}
    out: list[tuple[float, int]] = []

    def total() -> int:
        return sum(_need(s) for s in current.values())

    i = 0
    for t in [start, *sorted({e[0] for e in events if start < e[0] < end}), end]:
        while i < len(events) and events[i][0] <= t:
            _, report, sample = events[i]
            seen = current.get(sample.router_id)
            if report and (seen is None or sample.at >= seen.at):
                current[sample.router_id] = sample
            elif not report and seen is sample:
                del current[sample.router_id]
            i += 1
        out.append((t, total()))
    return out


def average_need(
    samples: Sequence[LoadSample], start: float, end: float, expire_s: float = EXPIRE_S
) -> float:
    """The time-weighted average need over [start, end] (the need at ``end`` if empty)."""
    if end <= start:
        return float(need_at(samples, end, expire_s))
    found = steps(samples, start, end, expire_s)
    area = sum(need * (b - a) for (a, need), (b, _) in pairwise(found))
    return area / (end - start)


def peak_need(
    samples: Sequence[LoadSample], start: float, end: float, expire_s: float = EXPIRE_S
) -> int:
    """The highest need at any moment of [start, end]."""
    return max(need for _, need in steps(samples, start, end, expire_s))


def replicas_for(need: float, policy: AutoscalePolicy) -> int:
    """Replicas that carry ``need`` at ``target_inflight`` each (unclamped)."""
    return max(0, math.ceil(need / policy.target_inflight - _EPSILON))


def _clamp(count: int, low: int, policy: AutoscalePolicy) -> int:
    return max(low, min(policy.max_replicas, count))


def decide(
    policy: AutoscalePolicy,
    samples: Sequence[LoadSample],
    desired: int,
    clock: Clock,
    expire_s: float = EXPIRE_S,
) -> Choice:
    """The desired count for the load in ``samples`` (unchanged: no reason)."""
    now = clock.now
    low, high, target = policy.min_replicas, policy.max_replicas, policy.target_inflight
    idle_for = now - clock.last_activity
    if low == 0 and idle_for >= policy.idle_timeout_s and not clock.starting:
        if desired == 0:
            return Choice(0)
        return Choice(
            0,
            f"scale {desired} -> 0: no request for {idle_for:.0f} s "
            f"(idle timeout {policy.idle_timeout_s:g} s)",
        )
    if desired > high:
        return Choice(high, f"scale {desired} -> {high}: above max_replicas {high}")
    if desired < low:
        return Choice(low, f"scale {desired} -> {low}: below min_replicas {low}")
    # At zero only load brings replicas back; above it, one stays until idle.
    floor = max(low, 1) if desired > 0 else low
    # Before a router's first report there was no load: the window is whole.
    start = now - policy.scale_up_window_s
    average = average_need(samples, start, now, expire_s)
    if desired == 0:
        # The report just in has no weight in the average yet: at zero, any
        # request waiting must bring a replica at once.
        waiting = need_at(samples, now, expire_s)
        up = _clamp(replicas_for(max(average, waiting), policy), floor, policy)
        if up > 0:
            return Choice(up, f"scale 0 -> {up}: {waiting} requests while scaled to zero")
    up = _clamp(replicas_for(average, policy), floor, policy)
    if up > desired:
        per = average / max(desired, 1)
        return Choice(
            up,
            f"scale {desired} -> {up}: {per:.1f} in flight per replica "
            f"over {now - start:.0f} s, target {target:g}",
        )
    window = policy.scale_down_window_s
    if now - clock.last_change < window:
        return Choice(desired)
    peak = peak_need(samples, now - window, now, expire_s)
    down = _clamp(replicas_for(peak, policy), floor, policy)
    if down < desired:
        per = peak / max(desired, 1)
        return Choice(
            down,
            f"scale {desired} -> {down}: at most {per:.1f} in flight per replica "
            f"over {window:g} s, target {target:g}",
        )
    return Choice(desired)


def next_check(
    policy: AutoscalePolicy,
    samples: Sequence[LoadSample],
    desired: int,
    clock: Clock,
    expire_s: float = EXPIRE_S,
) -> float | None:
    """The next moment :func:`decide` may answer differently with no new report.

    Reports wake the deployment anyway; this is what a durable timer must
    wake it for: the idle timeout, the down window running out, a silent
    router's report expiring. None: nothing changes until a report arrives.
    """
    now = clock.now
    due: list[float] = []
    if policy.min_replicas == 0 and desired > 0 and not clock.starting:
        due.append(clock.last_activity + policy.idle_timeout_s)
    if desired > max(policy.min_replicas, 1):
        window = policy.scale_down_window_s
        # The down window must be free of any moment needing ``desired``:
        # find when the last such stretch ended.
        found = steps(samples, now - window, now, expire_s)
        high_until = 0.0
        for (_, need), (b, _) in pairwise(found):
            if replicas_for(need, policy) >= desired:
                high_until = b
        if replicas_for(found[-1][1], policy) < desired:
            due.append(max(clock.last_change, high_until) + window)
    for sample in load_at(samples, now, expire_s):
        due.append(sample.at + expire_s)
    later = [t for t in due if t > now]
    return min(later) if later else None


def prune(
    samples: list[LoadSample],
    policy: AutoscalePolicy | None,
    now: float,
    per_router: int = 256,
    routers: int = 16,
    expire_s: float = EXPIRE_S,
) -> list[LoadSample]:
    """What the windows still need: reports younger than the longest window
    (plus the expiry, for the report in force at its start), at most
    ``per_router`` a router and the ``routers`` that reported last."""
    keep_s = (
        max(policy.scale_up_window_s, policy.scale_down_window_s) if policy else 0.0
    ) + expire_s
    young = sorted((s for s in samples if now - s.at <= keep_s), key=lambda s: s.at)
    by_router: dict[str, list[LoadSample]] = {}
    for sample in young:
        by_router.setdefault(sample.router_id, []).append(sample)
    recent = sorted(by_router, key=lambda r: by_router[r][-1].at, reverse=True)[:routers]
    kept = [s for r in recent for s in by_router[r][-per_router:]]
    return sorted(kept, key=lambda s: s.at)
