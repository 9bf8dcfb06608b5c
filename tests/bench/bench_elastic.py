"""Elastic serving benchmark (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_elastic [--base-rate 2.5] [--phase-s 30 20 30] [--wakes 5]

A real router, control worker, agent and tiny llama.cpp replicas (one slot,
one thread each). Open-loop Poisson arrivals through the router, the rate
stepping 1x -> 10x -> 1x, run twice on the same arrival times: once against
an autoscaled model (min 1, max ``--max-replicas``) and once against a fixed
count sized for the mean rate. Printed for each: the share of requests
answered within the latency SLO (end to end, from the arrival's scheduled
moment; a refusal counts as a miss), latency p50/p95/p99 and replica-seconds
(replicas holding a slot, starting and draining included, sampled twice a
second from the first arrival to the last answer); and what a fixed count
sized for the peak would use. Then ``--wakes`` wakes from zero through the
router: the first request's answer minus the engine's own load (its
replica's LOADING -> READY), as tests/bench/bench_wake.py measures the
orchestration alone.

The base rate is calibrated so the peak is ``--peak-load`` times what one
replica answers when always busy (measured first), unless ``--base-rate``
is given. On 2 shared cores three one-thread replicas answer about 1.6 times
what one does (CPU-bound), so the peak stays under that.
"""

import argparse
import asyncio
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
from temporalio.client import Client

from llmgw import replicas
from llmgw.temporal import connect
from llmgw.types import (
    AutoscalePolicy,
    DeploymentStatus,
    EngineProfile,
    ModelSpec,
    QueuePolicy,
    ReplicaTimeouts,
)
from llmgw_cli.dev.tinymodel import TinyModel, generate_tiny_model
from tests.bench.timing import load_seconds
from tests.harness import System, free_port, start_devserver, wait_deployment

TIMEOUTS = ReplicaTimeouts(router_grace_s=0.5, drain_s=10)
QUEUE = QueuePolicy(max_waiting=4096, max_wait_s=120)
# The utilisation a fixed count is sized for.
RHO = 0.7
BODY = {"prompt": "Count to ten:", "max_tokens": 128, "ignore_eos": True}
ELASTIC, FIXED, WOKEN = "tiny-elastic", "tiny-fixed", "tiny-wakes"


def _spec(tiny: TinyModel, name: str, policy: AutoscalePolicy | None) -> ModelSpec:
    return ModelSpec(
        name=name,
        source=str(tiny.model_path),
        context_length=512,
        profile=EngineProfile(max_inflight=1),
        autoscale=policy,
        queue=QUEUE,
    )


def _holding(status: DeploymentStatus) -> int:
    return sum(1 for s in status.slots if s.replica_id)


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass
class Run:
    # (scheduled arrival, seconds to the answer; inf when refused)
    latencies: list[tuple[float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    replica_s: float = 0.0
    peak_replicas: int = 0
    seconds: float = 0.0
    began_wall: float = 0.0


class Bench:
    def __init__(self, client: Client, http: httpx.AsyncClient, key: str) -> None:
        self.client = client
        self.http = http
        self.headers = {"Authorization": f"Bearer {key}"}

    async def ask(self, model: str, max_tokens: object = BODY["max_tokens"]) -> str:
        """One completion through the router: "" when 200, else what came instead."""
        body = {**BODY, "model": model, "max_tokens": max_tokens}
        try:
            r = await self.http.post("/v1/completions", json=body, headers=self.headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "" if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"

    async def throughput(self, model: str, seconds: float = 5.0) -> float:
        """Requests per second one replica answers with two always waiting for it
        (its engine busy all the time), after a short warm-up."""
        for _ in range(3):
            failed = await self.ask(model)
            assert not failed, failed
        count = 0
        stop = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal count
            while time.perf_counter() < stop:
                failed = await self.ask(model)
                assert not failed, failed
                count += 1

        await asyncio.gather(client(), client())
        return count / seconds

    async def run(self, model: str, arrivals: list[float]) -> Run:
        """Send a request at each moment of ``arrivals`` (seconds from now)."""
        run = Run()
        done = asyncio.Event()
        began = time.perf_counter()
        run.began_wall = time.time()

        async def sample() -> None:
            last = time.perf_counter()
            while not done.is_set():
                status = await replicas.deployment_status(self.client, model)
                now = time.perf_counter()
                held = _holding(status)
                run.replica_s += held * (now - last)
                run.peak_replicas = max(run.peak_replicas, held)
                last = now
                await asyncio.sleep(0.5)

        async def one(at: float) -> None:
            failed = await self.ask(model)
            latency = time.perf_counter() - (began + at)
            if failed:
                run.failures.append(failed)
                latency = math.inf
            run.latencies.append((at, latency))

        sampler = asyncio.create_task(sample())
        tasks = []
        for at in arrivals:
            delay = began + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(at)))
        await asyncio.gather(*tasks)
        done.set()
        await sampler
        run.seconds = time.perf_counter() - began
        return run

    async def wake(self, model: str) -> tuple[float, float]:
        """From zero: (first request to its answer, the engine's own load), in seconds."""
        await wait_deployment(self.client, model, lambda s: s.desired == 0 and not s.slots, 120)
        await self.until_listed(model, "scaled-to-zero")
        began = time.perf_counter()
        failed = await self.ask(model, max_tokens=1)  # the wake, not the generation
        total = time.perf_counter() - began
        assert not failed, failed
        status = await replicas.deployment_status(self.client, model)
        replica = await replicas.status_of(self.client, status.slots[0].replica_id)
        assert replica is not None
        steps = [(h.phase, h.at) for h in replica.history]
        return total, load_seconds(steps)

    async def until_listed(self, model: str, state: str) -> None:
        async with asyncio.timeout(60):
            while True:
                r = await self.http.get("/v1/models", headers=self.headers)
                if {m["id"]: m["llmgw_state"] for m in r.json()["data"]}.get(model) == state:
                    return
                await asyncio.sleep(0.1)


def poisson(rates: list[tuple[float, float]], seed: int) -> list[float]:
    """Arrival moments for consecutive (rate per second, seconds) phases."""
    rng = random.Random(seed)
    arrivals, start = [], 0.0
    for rate, seconds in rates:
        t = start
        while (t := t + rng.expovariate(rate)) < start + seconds:
            arrivals.append(t)
        start += seconds
    return arrivals


def report(name: str, run: Run, slo_s: float, bounds: list[float]) -> None:
    """One run's line, then its share within the SLO per phase."""
    every = [x for _, x in run.latencies]
    finite = [x for x in every if math.isfinite(x)]
    met = sum(1 for x in every if x <= slo_s)
    print(
        f"  {name:<22} {len(every):5d} requests  {100 * met / len(every):6.2f} %"
        f" within SLO  p50 {_pct(finite, 50):6.2f} s  p95 {_pct(finite, 95):6.2f} s"
        f"  p99 {_pct(finite, 99):6.2f} s  {run.replica_s:7.1f} replica-s"
        f" (peak {run.peak_replicas})  refused {len(run.failures)}"
    )
    phases = []
    for label, low, high in (
        ("1x", 0.0, bounds[0]),
        ("10x", bounds[0], bounds[1]),
        ("1x", bounds[1], math.inf),
    ):
        part = [x for at, x in run.latencies if low <= at < high]
        share = 100 * sum(1 for x in part if x <= slo_s) / max(1, len(part))
        phases.append(f"{label} {share:.1f} % of {len(part)}")
    misses = [at for at, x in run.latencies if x > slo_s]
    span = f", misses arrived {min(misses):.1f}..{max(misses):.1f} s" if misses else ""
    print(f"      by phase: {', '.join(phases)}{span}")
    for failure in sorted(set(run.failures))[:3]:
        print(f"      e.g. {failure}")


def timeline(run: Run, status: DeploymentStatus, latencies: bool) -> None:
    """The scale decisions (and the latency) over the run, 5 s at a time."""
    for d in status.decisions[-12:]:
        at = datetime.fromisoformat(d.at).timestamp() - run.began_wall
        print(f"      at {at:6.1f} s: {d.reason}")
    if not latencies:
        return
    for start in range(0, int(max(at for at, _ in run.latencies)) + 1, 5):
        part = [x for at, x in run.latencies if start <= at < start + 5]
        if part:
            print(f"      {start:3d} s: {len(part):4d} arrivals, p50 {_pct(part, 50):5.2f} s,"
                  f" max {max(part):5.2f} s")  # fmt: skip


async def compare(b: Bench, args: argparse.Namespace, tiny: TinyModel) -> None:
    """The same arrivals against the autoscaled model and a fixed count for the mean."""
    policy = AutoscalePolicy(
        min_replicas=1,
        max_replicas=args.max_replicas,
        target_inflight=1,
        scale_up_window_s=args.up_s,
        scale_down_window_s=args.down_s,
        idle_timeout_s=3600,
    )
    elastic, fixed = _spec(tiny, ELASTIC, policy), _spec(tiny, FIXED, None)
    await replicas.apply_deployment(b.client, elastic, 1, timeouts=TIMEOUTS)
    await wait_deployment(b.client, ELASTIC, lambda s: sum(x.ready for x in s.slots) == 1)
    await b.until_listed(ELASTIC, "ready")
    capacity = await b.throughput(ELASTIC)
    p1, p2, p3 = args.phase_s
    base = args.base_rate or args.peak_load * capacity / 10
    phases = [(base, p1), (10 * base, p2), (base, p3)]
    mean = sum(r * s for r, s in phases) / sum(s for _, s in phases)
    # Sized to run at most RHO busy, as a fixed count would be provisioned.
    fixed_n = max(1, math.ceil(mean / capacity / RHO))
    peak_n = math.ceil(10 * base / capacity / RHO)
    arrivals = poisson(phases, args.seed)
    print(
        f"one replica answers {capacity:.1f} req/s ({BODY['max_tokens']} tokens each);"
        f" rates {base:.2f} -> {10 * base:.2f} -> {base:.2f} req/s over"
        f" {p1:g} + {p2:g} + {p3:g} s ({len(arrivals)} arrivals, seed {args.seed});"
        f" mean {mean:.2f} req/s; sized for {RHO:.0%} busy: {fixed_n} for the mean,"
        f" {peak_n} for the peak"
    )
    print(f"SLO: answered within {args.slo_s:g} s (end to end, non-streaming)")
    elastic_run = await b.run(ELASTIC, arrivals)
    decided = await replicas.deployment_status(b.client, ELASTIC)
    await replicas.remove_deployment(b.client, elastic, 60)
    if args.elastic_only:
        report("elastic", elastic_run, args.slo_s, [p1, p1 + p2])
        timeline(elastic_run, decided, latencies=True)
        return

    await replicas.apply_deployment(b.client, fixed, fixed_n, timeouts=TIMEOUTS)
    await wait_deployment(b.client, FIXED, lambda s: sum(x.ready for x in s.slots) == fixed_n)
    await b.until_listed(FIXED, "ready")
    fixed_run = await b.run(FIXED, arrivals)
    await replicas.remove_deployment(b.client, fixed, 60)

    print(
        f"autoscale {policy.min_replicas}..{policy.max_replicas}, target 1 in flight per"
        f" replica (one slot each), up window {args.up_s:g} s, down window {args.down_s:g} s:"
    )
    bounds = [p1, p1 + p2]
    report("elastic", elastic_run, args.slo_s, bounds)
    timeline(elastic_run, decided, latencies=False)
    report(f"fixed {fixed_n} (mean)", fixed_run, args.slo_s, bounds)
    print(
        f"  fixed {peak_n} (peak), not run:  {peak_n * elastic_run.seconds:7.1f} replica-s"
        f" over the elastic run's {elastic_run.seconds:.1f} s"
    )


async def wakes(b: Bench, count: int, refresh_s: float, tiny: TinyModel) -> None:
    """``count`` wakes from zero through the router."""
    policy = AutoscalePolicy(min_replicas=0, max_replicas=1, idle_timeout_s=1)
    woken = _spec(tiny, WOKEN, policy)
    await replicas.apply_deployment(b.client, woken, 1, timeouts=TIMEOUTS)
    totals, loads = [], []
    for _ in range(count):
        total, load = await b.wake(WOKEN)
        totals.append(total)
        loads.append(load)
    rest = [t - lo for t, lo in zip(totals, loads, strict=True)]
    print(
        f"wake from zero through the router, {count} wakes (table refresh every {refresh_s:g} s):"
    )
    for name, values in (
        ("first request to answer", totals),
        ("engine's own load", loads),
        ("wake less engine load", rest),
    ):
        p50, p95 = _pct(values, 50) * 1e3, _pct(values, 95) * 1e3
        print(f"  {name:<24} p50 {p50:7.0f} ms  p95 {p95:7.0f} ms")
    await replicas.remove_deployment(b.client, woken, 60)


async def bench(args: argparse.Namespace, root: Path, address: str) -> None:
    system = System(address, root / "llmgw", free_port())
    system.env["LLMGW_REFRESH_INTERVAL_S"] = str(args.refresh_s)
    system.work_dir.mkdir()
    try:
        client = await connect(address)
        tiny = generate_tiny_model(root / "tiny")
        # The router reads the catalog: every model the runs deploy, with its policy.
        policy = AutoscalePolicy(min_replicas=0, max_replicas=args.max_replicas)
        key = system.catalog(
            *(_spec(tiny, name, policy) for name in (ELASTIC, WOKEN)), _spec(tiny, FIXED, None)
        )
        started = await system.start(client, "bench-node")
        async with httpx.AsyncClient(
            base_url=started.root,
            timeout=300,
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
        ) as http:
            b = Bench(client, http, key)
            if not args.skip_runs:
                await compare(b, args, tiny)
            if args.wakes:
                await wakes(b, args.wakes, args.refresh_s, tiny)
    finally:
        system.stop()


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, nargs=3, default=[30.0, 20.0, 30.0])
    parser.add_argument("--base-rate", type=float, default=0.0, help="req/s (0: calibrate)")
    parser.add_argument("--peak-load", type=float, default=1.4,
                        help="the peak rate in replicas' worth (calibration)")  # fmt: skip
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--slo-s", type=float, default=2.0)
    parser.add_argument("--up-s", type=float, default=2.0)
    parser.add_argument("--down-s", type=float, default=8.0)
    parser.add_argument("--refresh-s", type=float, default=1.0, help="the router's table refresh")
    parser.add_argument("--wakes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--skip-runs", action="store_true", help="only the wakes")
    parser.add_argument("--elastic-only", action="store_true", help="no fixed run")
    return parser.parse_args()


async def main() -> None:
    args = _args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        root = Path(tmp)
        port = free_port()
        server = start_devserver(root / "temporal.db", port, root / "temporal.log")
        try:
            await bench(args, root, f"127.0.0.1:{port}")
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
