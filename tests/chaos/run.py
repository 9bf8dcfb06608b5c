"""One randomized fault run on a cluster: traffic throughout, a fault every
``every_s`` seconds, the counts checked after each heal, the books at the end.
"""

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from temporalio.client import Client

from llmgw.temporal import connect
from tests.chaos.checks import converge, usage_of
from tests.chaos.faults import Fault, draw, heal, strike
from tests.chaos.load import MAX_TOKENS, Load, Outcome, batch_lines, submit_batch
from tests.cluster.scenario import CONTROLS, NODES, ROUTERS, deploy, ok, routable
from tests.cluster.stack import NAMESPACE, Cluster

REPLICAS = 4
# A failure this long after a heal is still the fault's (a client's retry
# budget, a router's refresh, HAProxy's health checks).
GRACE_S = 10.0
# Exact counts are the goal within 30 s of a heal; past this bound they count
# as a violation.
RECOVERY_GOAL_S = 30.0
BATCH_LINES = 20
# The classes whose usage is checked request for request (a key each).
BILLED = ("chat", "stream", "completion")


@dataclass
class Report:
    """What a run did and found."""

    seed: int
    minutes: float
    every_s: float
    faults: list[dict[str, object]] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    succeeded: dict[str, int] = field(default_factory=dict)
    failed_by_cause: dict[str, int] = field(default_factory=dict)
    shed: int = 0
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    batch: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    slowest_recovery_s: float = 0.0

    def text(self) -> str:
        """The report as a person reads it."""
        lines = [
            f"seed {self.seed}, {self.minutes:g} min, a fault every {self.every_s:g} s",
            f"requests sent {sum(self.sent.values())} {self.sent}",
            f"succeeded {sum(self.succeeded.values())} {self.succeeded}",
            f"failed by cause {self.failed_by_cause or '{}'}; shed {self.shed}",
            f"usage {self.usage}; batch {self.batch}",
            f"faults ({len(self.faults)}):",
        ]
        for f in self.faults:
            rec = f["recovered_s"]
            took = f"{rec:.1f}s" if isinstance(rec, float) else "NOT RECOVERED"
            lines.append(f"  {f['at']:7.1f}s {f['what']}: exact again {took} after the heal")
        lines.append(f"slowest recovery {self.slowest_recovery_s:.1f}s (goal {RECOVERY_GOAL_S:g}s)")
        lines.append(f"violations ({len(self.violations)}):")
        lines += [f"  {v}" for v in self.violations] or ["  none"]
        return "\n".join(lines)

    def json(self) -> str:
        """The report as JSON."""
        return json.dumps(asdict(self), indent=2)


def _key(cluster: Cluster, name: str) -> tuple[str, int]:
    made = cluster.cli("keys", "create", name)
    out = ok(made)
    found = re.search(r"key (\d+) \(", made.stdout + made.stderr)
    assert found, made.stdout + made.stderr
    return out.strip().splitlines()[-1], int(found.group(1))


def attribute(outcome: Outcome, faults: list[Fault]) -> str | None:
    """The kind of the fault that explains a failed request, or None."""
    for fault in faults:
        if fault.struck_at and fault.explains(
            outcome.what, outcome.started, outcome.ended, GRACE_S
        ):
            return fault.kind.value
    return None


async def fault_run(
    cluster: Cluster, minutes: float, seed: int, every_s: float, rate_per_s: float = 3.0
) -> Report:
    """Run traffic and faults on ``cluster`` for ``minutes``; the report."""
    rng = random.Random(seed)
    report = Report(seed, minutes, every_s)
    deploy(cluster, REPLICAS)
    keys = {what: _key(cluster, f"chaos-{what}") for what in (*BILLED, "response")}
    client = await connect(cluster.temporal.address, NAMESPACE)
    recovered, problems = await converge(cluster, client, NODES, REPLICAS, 300)
    assert recovered is not None, f"the cluster never became exact: {problems}"
    jobs_key = keys["response"][0]
    await routable(cluster)
    batch_id = await submit_batch(cluster.base_url, jobs_key, BATCH_LINES)
    load = Load(
        cluster.base_url,
        {what: key for what, (key, _) in keys.items()},
        rate_per_s,
        random.Random(rng.random()),
    )
    sending = asyncio.create_task(load.run())
    began = time.monotonic()
    faults: list[Fault] = []
    try:
        end = began + minutes * 60
        while time.monotonic() + every_s <= end:
            slot = time.monotonic()
            faults.append(await _one_fault(cluster, client, rng, report, began, every_s))
            rest = slot + every_s - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)  # the next fault's slot
    finally:
        load.stop()
        await sending
    ids = {what: key_id for what, (_, key_id) in keys.items()}
    await asyncio.to_thread(_books, cluster, report, load, faults, ids)
    await _batch_check(cluster.base_url, jobs_key, batch_id, report)
    report.slowest_recovery_s = max(
        (f.recovered_s for f in faults if f.recovered_s is not None), default=0.0
    )
    return report


async def _one_fault(
    cluster: Cluster, client: Client, rng: random.Random, report: Report, began: float,
    every_s: float,
) -> Fault:  # fmt: skip
    """Draw a fault, strike, hold, heal, and time the way back to exact counts."""
    fault = draw(rng, NODES, ROUTERS, CONTROLS, max_hold_s=every_s / 2)
    fault.struck_at = time.monotonic()
    await asyncio.to_thread(strike, cluster, fault)
    await asyncio.sleep(fault.hold_s)  # the fault lasts this long: the schedule
    await asyncio.to_thread(heal, cluster, fault)
    fault.healed_at = time.monotonic()
    fault.recovered_s, left = await converge(cluster, client, NODES, REPLICAS, 180)
    at = fault.struck_at - began
    report.faults.append({"at": at, "what": fault.describe(), "recovered_s": fault.recovered_s})
    if fault.recovered_s is None:
        report.violations.append(f"{fault.describe()}: not exact 180s after: {left}")
    elif fault.recovered_s > RECOVERY_GOAL_S:
        report.violations.append(
            f"{fault.describe()}: exact only {fault.recovered_s:.1f}s after the heal"
        )
    print(f"[{at:6.1f}s] {fault.describe()}: recovered {fault.recovered_s}", flush=True)
    return fault


async def _batch_check(base_url: str, key: str, batch_id: str, report: Report) -> None:
    """Every line of the batch in its output or error file, exactly once."""
    served, errors = await batch_lines(base_url, key, batch_id, 600)
    counts = Counter(served + errors)
    report.batch = {"lines": BATCH_LINES, "served": len(served), "errors": len(errors)}
    wrong = {f"line-{n}": counts[f"line-{n}"] for n in range(BATCH_LINES)}
    wrong = {k: v for k, v in wrong.items() if v != 1}
    if wrong or len(served) + len(errors) != BATCH_LINES:
        report.violations.append(f"batch lines not exactly once: {wrong}")
    # A line's request is retried through faults; one that still failed
    # failed on a fault the run cannot tie it to: a violation too.
    if errors:
        report.violations.append(f"batch lines failed: {sorted(errors)[:10]}")


def _books(
    cluster: Cluster, report: Report, load: Load, faults: list[Fault], key_ids: dict[str, int]
) -> None:
    """Outcomes by class and cause, and each class's usage against what the client saw."""
    report.sent = dict(load.sent)
    report.shed = load.shed
    causes: Counter[str] = Counter()
    for o in load.outcomes:
        if o.ok:
            report.succeeded[o.what] = report.succeeded.get(o.what, 0) + 1
            continue
        cause = attribute(o, faults)
        causes[cause or "unattributed"] += 1
        if cause is None:
            report.violations.append(f"unattributed failure: {o.id} {o.what} {o.error}")
    report.failed_by_cause = dict(causes)
    for what in BILLED:
        _billed(cluster, report, [o for o in load.outcomes if o.what == what], what, key_ids[what])


def _billed(cluster: Cluster, report: Report, sent: list[Outcome], what: str, key_id: int) -> None:
    """Usage of one request class's key: every request seen to succeed billed
    exactly once, tokens as the client saw them, nothing billed never sent."""
    seen_ok = [o for o in sent if o.ok]
    failed = len(sent) - len(seen_ok)
    deadline = time.monotonic() + 60
    while True:  # routers write usage in batches: until it is all in, or a minute
        requests, errors, tokens = usage_of(cluster, key_id)
        if requests - errors >= len(seen_ok) or time.monotonic() > deadline:
            break
        time.sleep(1)
    client_tokens = sum(o.tokens for o in seen_ok)
    report.usage[what] = {
        "client_ok": len(seen_ok), "client_failed": failed, "billed_requests": requests,
        "billed_errors": errors, "client_tokens": client_tokens, "billed_tokens": tokens,
    }  # fmt: skip
    if requests > len(sent):
        report.violations.append(f"{what} usage: {requests} requests billed, {len(sent)} sent")
    if requests - errors < len(seen_ok):
        report.violations.append(
            f"{what} usage lost: {requests - errors} billed as served, {len(seen_ok)} seen"
        )
    if requests - errors > len(sent):
        report.violations.append(f"{what} usage: more billed as served than sent")
    if tokens < client_tokens:
        report.violations.append(f"{what} tokens lost: {tokens} billed, {client_tokens} seen")
    if tokens > client_tokens + failed * MAX_TOKENS:
        report.violations.append(f"{what} tokens: {tokens} billed, {client_tokens} seen")
