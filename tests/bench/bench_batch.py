"""Batches beside interactive load (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_batch [--replicas 2] [--parallel 2]
        [--max-tokens 16] [--capacity-seconds 20] [--seconds 60] [--lines 2000]
        [--load 0.5] [--kills] [--kill-lines 10000]

Issue 25 §4. The real processes: a Temporal dev server, the control worker
(which runs the batch's workflow and chunk activities: the executor), one
agent, ``--replicas`` llama.cpp replicas of the tiny model (``--parallel``
slots each, the router's ``max_inflight`` set to match so its admission
queue knows the slots) and one router, which both the interactive load and
the batch's lines go through.

- **A, capacity**: a closed loop of replicas x parallel clients for
  ``--capacity-seconds``, each request ``--max-tokens`` tokens (ignore_eos):
  requests/s.
- **B, interactive alone**: open-loop Poisson arrivals at ``--load`` x the
  capacity for ``--seconds``: latency p50 and p95 (from the arrival's
  scheduled time, so a late start counts).
- **C, interactive with a batch**: the same arrivals, and a batch of
  ``--lines`` lines (the same request, class ``batch``) created through the
  official openai client at the start; the interactive load runs until the
  batch has ended (at least ``--seconds``, at most ``--max-seconds``):
  interactive p50/p95, the batch's lines/s while the load ran, against the
  idle capacity (capacity - interactive rate).
- ``--kills``: afterwards, a ``--kill-lines`` batch alone; the control
  worker is SIGKILLed at 10 % of its lines and the router at 40 % (each is
  started again); the output's unique ``custom_id`` count is printed
  (the goal: exactly ``--kill-lines``).

The interactive load is sent with httpx (lighter than the openai client,
so the load generator takes less of the CPU); the batch uses the openai
client (files.create, batches.create, retrieve, files.content). On a small
machine the load generator, the router, the executor and the engines share
the same cores: the figures say how they share them, not what each could do
alone.
"""

import argparse
import asyncio
import io
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from sqlmodel import func, select
from temporalio.client import Client

from llmgw import replicas
from llmgw.store import Store
from llmgw.store.openai_tables import BatchResult
from llmgw.temporal import connect
from llmgw.types import EngineKind, EngineProfile, ModelSpec
from llmgw_cli.dev.tinymodel import generate_tiny_model
from llmgw_cli.procs import Child
from tests.bench.procs import stop_replicas
from tests.bench.timing import percentile_ms
from tests.harness import System, free_port, start_devserver, wait_routable

MODEL = "tiny-batch-bench"
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class Bench:
    """What every phase needs: the router, its key, the store, the sizes."""

    base: str
    key: str
    store: Store
    max_tokens: int
    seed: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def body(self, i: int) -> dict[str, object]:
        """One request: ``max_tokens`` tokens whatever the model says."""
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"say something about {i}"}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }


async def capacity(bench: Bench, http: httpx.AsyncClient, clients: int, seconds: float) -> float:
    """Phase A: completed requests/s of a closed loop of ``clients`` clients."""
    done = 0
    stop = time.perf_counter() + seconds

    async def loop(n: int) -> None:
        nonlocal done
        i = n * 1_000_000
        while time.perf_counter() < stop:
            r = await http.post("/chat/completions", json=bench.body(i))
            r.raise_for_status()
            done += 1
            i += 1

    began = time.perf_counter()
    await asyncio.gather(*(loop(n) for n in range(clients)))
    return done / (time.perf_counter() - began)


@dataclass
class Interactive:
    """One open-loop run's results: per answered request (its scheduled
    arrival, how late the load generator sent it, its latency), seconds."""

    samples: list[tuple[float, float, float]]
    errors: int
    seconds: float
    kinds: dict[str, int] = field(default_factory=dict)  # errors by status or exception

    @property
    def rate(self) -> float:
        return (len(self.samples) + self.errors) / self.seconds

    def p(self, q: int, until: float | None = None) -> float:
        """Latency percentile (ms), of the arrivals before ``until`` if given."""
        values = [lat for at, _, lat in self.samples if until is None or at < until]
        return percentile_ms(values, q) if len(values) > 1 else float("nan")

    def late(self, q: int) -> float:
        """How late the load generator sent requests (ms): its own lag."""
        values = [lag for _, lag, _ in self.samples]
        return percentile_ms(values, q) if len(values) > 1 else float("nan")


async def open_loop(
    bench: Bench,
    http: httpx.AsyncClient,
    rate: float,
    until: Callable[[float], bool],
) -> Interactive:
    """Poisson arrivals at ``rate``/s until ``until(elapsed)``; every request awaited."""
    samples: list[tuple[float, float, float]] = []
    errors = 0
    kinds: dict[str, int] = {}

    def failed(kind: str) -> None:
        nonlocal errors
        errors += 1
        kinds[kind] = kinds.get(kind, 0) + 1

    async def one(i: int, scheduled: float) -> None:
        lag = time.perf_counter() - scheduled
        try:
            r = await http.post("/chat/completions", json=bench.body(i))
            if r.status_code != 200:
                failed(str(r.status_code))
                return
        except httpx.HTTPError as exc:
            failed(type(exc).__name__)
            return
        samples.append((scheduled, lag, time.perf_counter() - scheduled))

    tasks = []
    began = time.perf_counter()
    at = began
    i = 0
    while not until(at - began):
        at += bench.rng.expovariate(rate)
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, at)))
        i += 1
    seconds = time.perf_counter() - began
    await asyncio.gather(*tasks)
    return Interactive(samples, errors, seconds, kinds)


ADMIN = "llmgw-bench-batch-admin"
WATCHED = ("llmgw_queue_wait_seconds", "llmgw_request_duration_seconds")


async def router_view(http: httpx.AsyncClient) -> dict[str, float]:
    """The router's own sums and counts of queue wait and request duration
    (both classes together), from its /metrics."""
    r = await http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    totals: dict[str, float] = {}
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in WATCHED:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def print_router_view(before: dict[str, float], after: dict[str, float]) -> None:
    parts = []
    for what in WATCHED:
        n = after.get(f"{what}_count", 0) - before.get(f"{what}_count", 0)
        total = after.get(f"{what}_sum", 0) - before.get(f"{what}_sum", 0)
        parts.append(f"{what} mean {total / n * 1e3:.0f} ms" if n else f"{what}: none")
    print("  the router's view (both classes): " + ", ".join(parts))


def results(store: Store, batch_id: str) -> int:
    """Lines of the batch recorded so far (one row per custom_id)."""
    with store.session() as session:
        return int(
            session.exec(
                select(func.count())
                .select_from(BatchResult)
                .where(BatchResult.batch_id == batch_id)
            ).one()
        )


def batch_file(bench: Bench, lines: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": bench.body(i),
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )


async def create_batch(oai: openai.AsyncOpenAI, bench: Bench, lines: int) -> tuple[str, float]:
    """Upload and create; returns the batch id and when it was created."""
    made = await oai.files.create(
        file=("in.jsonl", io.BytesIO(batch_file(bench, lines))), purpose="batch"
    )
    created = time.perf_counter()
    batch = await oai.batches.create(
        input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id, created


async def wait_batch(oai: openai.AsyncOpenAI, batch_id: str, timeout_s: float) -> str:
    async with asyncio.timeout(timeout_s):
        while (batch := await oai.batches.retrieve(batch_id)).status not in TERMINAL:
            await asyncio.sleep(0.5)
    return batch.status


async def unique_lines(oai: openai.AsyncOpenAI, batch_id: str) -> tuple[int, int, int]:
    """(output lines, unique custom_ids in them, error-file lines)."""
    batch = await oai.batches.retrieve(batch_id)
    out: list[str] = []
    if batch.output_file_id:
        out = (await oai.files.content(batch.output_file_id)).text.splitlines()
    errs = 0
    if batch.error_file_id:
        errs = len((await oai.files.content(batch.error_file_id)).text.splitlines())
    ids = {json.loads(line)["custom_id"] for line in out}
    return len(out), len(ids), errs


async def until(check: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.2)


async def killed(child: Child) -> None:
    child.signal(signal.SIGKILL)
    async with asyncio.timeout(30):
        while child.alive():
            await asyncio.sleep(0.05)


async def kills(
    bench: Bench,
    oai: openai.AsyncOpenAI,
    system: System,
    router: Child,
    restart_router: Callable[[], Awaitable[Child]],
    lines: int,
) -> None:
    """The --kills run: a batch alone, its control worker and router SIGKILLed."""
    batch_id, created = await create_batch(oai, bench, lines)
    await until(lambda: results(bench.store, batch_id) >= lines // 10, 1800)
    control = next(c for c in system.children if c.name == "control" and c.alive())
    await killed(control)
    system.spawn("control")
    print(f"  SIGKILLed the control worker at {results(bench.store, batch_id)} lines")
    await until(lambda: results(bench.store, batch_id) >= lines * 4 // 10, 1800)
    await killed(router)
    print(f"  SIGKILLed the router at {results(bench.store, batch_id)} lines")
    await restart_router()
    status = await wait_batch(oai, batch_id, 3600)
    took = time.perf_counter() - created
    out, unique, errs = await unique_lines(oai, batch_id)
    print(
        f"  {lines}-line batch after two SIGKILLs: {status} in {took:.0f} s;"
        f" output lines {out}, unique custom_ids {unique}, error lines {errs}"
        f"  (goal: exactly {lines} unique) -> {'met' if unique == lines == out else 'NOT met'}"
    )


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()
    return f"{os.cpu_count()} CPUs ({cpu}), load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"


@dataclass
class BatchBeside:
    """Phase C's batch: lines recorded while the interactive load ran."""

    lines: int
    seconds: float
    first_s: float | None
    status: str
    output: int
    unique: int
    errors: int
    ended_at: float  # perf_counter() of its last line (or of the load's end)

    @property
    def rate(self) -> float:
        return self.lines / max(self.seconds, 1e-9)


async def with_batch(
    bench: Bench,
    http: httpx.AsyncClient,
    oai: openai.AsyncOpenAI,
    rate: float,
    args: argparse.Namespace,
) -> tuple[Interactive, BatchBeside]:
    """Phase C: the interactive load, and a batch created at its start; the
    load runs until the batch has ended (at least --seconds)."""
    batch_id, created = await create_batch(oai, bench, args.lines)
    counts: list[tuple[float, int]] = []
    ended = False

    async def sample() -> None:
        nonlocal ended
        while not ended:
            n = await asyncio.to_thread(results, bench.store, batch_id)
            counts.append((time.perf_counter(), n))
            status = (await oai.batches.retrieve(batch_id)).status
            ended = counts[-1][1] >= args.lines or status in TERMINAL
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    beside = await open_loop(
        bench, http, rate, lambda t: t >= args.max_seconds or (t >= args.seconds and ended)
    )
    load_end = time.perf_counter()
    sampled = [(t, n) for t, n in counts if t <= load_end]
    last_t, last_n = sampled[-1] if sampled else (created, 0)
    # Lines/s while the load ran: from the create to the last line (or to
    # the end of the load, if the batch outlasted it).
    done_at = next((t for t, n in sampled if n >= args.lines), last_t)
    first = next((t - created for t, n in sampled if n > 0), None)
    ended = True
    await sampler
    status = await wait_batch(oai, batch_id, 3600)
    out, unique, errs = await unique_lines(oai, batch_id)
    return beside, BatchBeside(last_n, done_at - created, first, status, out, unique, errs, done_at)


def print_table(
    cap: float, load: float, alone: Interactive, beside: Interactive, batch: BatchBeside
) -> None:
    """The figures beside the goals, as a Markdown table."""
    idle = cap - beside.rate
    ratio = batch.rate / idle if idle > 0 else float("nan")
    # "With the batch": the arrivals while it ran (the load may outlast it).
    p50, p95 = beside.p(50, batch.ended_at), beside.p(95, batch.ended_at)
    p95_ratio = p95 / alone.p(95)
    rows = [
        ("capacity (closed loop)", f"{cap:.1f} requests/s", ""),
        (
            "interactive load (open loop), alone / with batch",
            f"{alone.rate:.1f} / {beside.rate:.1f} requests/s",
            f"~{load:.0%} of capacity",
        ),
        ("interactive p50, alone / while the batch ran", f"{alone.p(50):.0f} / {p50:.0f} ms", ""),
        ("interactive p95, alone / while the batch ran", f"{alone.p(95):.0f} / {p95:.0f} ms", ""),
        (
            "p95 with / without the batch",
            f"**{p95_ratio:.2f}x**",
            f"<= 1.2x ({'met' if p95_ratio <= 1.2 else 'NOT met'})",
        ),
        ("batch lines/s beside the load", f"{batch.rate:.1f}", ""),
        ("idle capacity (capacity - interactive)", f"{idle:.1f} requests/s", ""),
        (
            "batch / idle capacity",
            f"**{ratio:.0%}**",
            f">= 70 % ({'met' if ratio >= 0.7 else 'NOT met'})",
        ),
    ]
    print("\n| measure | figure | goal |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


async def measure(
    args: argparse.Namespace, system: System, bench: Bench, router: Child, router_port: int
) -> None:
    """Phases A, B, C (and the --kills run), printed."""
    print(f"machine: {machine()}")
    print(
        f"system: {args.replicas} llama.cpp replicas of the tiny model x --parallel"
        f" {args.parallel} (1 thread each), one router, the control worker (executor),"
        f" max_tokens {args.max_tokens}"
    )
    print(
        "NOTE: the load generator, router, control worker and engines all share this"
        f" machine's {os.cpu_count()} cores; other jobs on it move the figures."
    )
    headers = {"Authorization": f"Bearer {bench.key}"}
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    clients = args.replicas * args.parallel
    async with (
        httpx.AsyncClient(base_url=bench.base, headers=headers, limits=limits, timeout=600) as http,
        openai.AsyncOpenAI(
            base_url=bench.base, api_key=bench.key, max_retries=5, timeout=600
        ) as oai,
    ):
        await capacity(bench, http, clients, 3)  # warm up
        cap = await capacity(bench, http, clients, args.capacity_seconds)
        print(f"A capacity (closed loop, {clients} clients): {cap:.1f} requests/s")

        root = httpx.AsyncClient(base_url=bench.base.removesuffix("/v1"))
        seen = await router_view(root)
        alone = await open_loop(bench, http, args.load * cap, lambda t: t >= args.seconds)
        print(
            f"B interactive alone: {alone.rate:.1f}/s offered for {alone.seconds:.0f} s,"
            f" p50 {alone.p(50):.0f} ms, p95 {alone.p(95):.0f} ms, errors {alone.errors};"
            f" load generator's own lag p95 {alone.late(95):.0f} ms"
        )
        after = await router_view(root)
        print_router_view(seen, after)
        seen = after

        beside, batch = await with_batch(bench, http, oai, args.load * cap, args)
        print(
            f"C interactive with the batch: {beside.rate:.1f}/s for {beside.seconds:.0f} s,"
            f" p50 {beside.p(50):.0f} ms, p95 {beside.p(95):.0f} ms, errors {beside.errors}"
            + (f" {beside.kinds}" if beside.kinds else "")
            + ";"
            f" load generator's own lag p95 {beside.late(95):.0f} ms"
        )
        print(
            "  of the requests that arrived while the batch ran:"
            f" p50 {beside.p(50, batch.ended_at):.0f} ms, p95 {beside.p(95, batch.ended_at):.0f} ms"
        )
        print_router_view(seen, await router_view(root))
        await root.aclose()
        print(
            f"  batch of {args.lines}: {batch.lines} lines recorded while the load ran, over"
            f" {batch.seconds:.1f} s from create"
            + (f" (first line after {batch.first_s:.1f} s)" if batch.first_s is not None else "")
            + f": {batch.rate:.1f} lines/s; ended {batch.status}, output {batch.output} lines,"
            f" {batch.unique} unique, {batch.errors} error lines"
        )
        print_table(cap, args.load, alone, beside, batch)

        if args.kills:

            async def restart_router() -> Child:
                return system.start_router(router_port)

            await kills(bench, oai, system, router, restart_router, args.kill_lines)


async def run(args: argparse.Namespace, root: Path) -> None:
    """Start the system, measure, stop everything started."""
    port = free_port()
    server = start_devserver(root / "temporal.db", port, root / "temporal.log")
    router_port = free_port()
    system = System(
        f"127.0.0.1:{port}",
        root / "llmgw",
        free_port(),
        {
            # The executor sends the lines to the one router of the bench.
            "LLMGW_ROUTER_URLS": f"http://127.0.0.1:{router_port}",
            "LLMGW_JOB_SWEEP_INTERVAL_S": "1",
            # For the router's /metrics (its own view of queue waits).
            "LLMGW_ADMIN_KEY": ADMIN,
        },
    )
    system.work_dir.mkdir()
    rids: list[str] = []
    client: Client | None = None
    try:
        client = await connect(f"127.0.0.1:{port}")
        tiny = generate_tiny_model(root / "tiny")
        spec = ModelSpec(
            name=MODEL,
            engine=EngineKind.LLAMA_CPP,
            source=str(tiny.model_path),
            context_length=2048,
            engine_args=["--parallel", str(args.parallel)],
            # The router's admission queue counts the slots (batch_headroom).
            profile=EngineProfile(max_inflight=args.parallel),
        )
        system.catalog(spec)
        system.spawn("control")
        system.spawn("agent", {"LLMGW_NODE_ID": "bench-node"})
        await replicas.wait_node_registered(client, "bench-node", 120)
        rids = [await replicas.start_replica(client, spec) for _ in range(args.replicas)]
        for rid in rids:
            await replicas.wait_ready(client, rid, 300)
        router = system.start_router(router_port)
        base = f"http://127.0.0.1:{router_port}/v1"
        store = Store(system.store_url)
        try:
            key = store.create_api_key("bench")
            await wait_routable(base, key, MODEL, 120)
            bench = Bench(base, key, store, args.max_tokens, rng=random.Random(args.seed))
            await measure(args, system, bench, router, router_port)
        finally:
            store.close()
    finally:
        await stop_replicas(client, rids)
        system.stop()
        server.stop()
        if args.keep_logs:
            shutil.copytree(system.work_dir / "logs", args.keep_logs, dirs_exist_ok=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=2, help="slots per replica")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--capacity-seconds", type=float, default=20)
    parser.add_argument("--seconds", type=float, default=60, help="interactive load, at least")
    parser.add_argument("--max-seconds", type=float, default=600, help="phase C at most")
    parser.add_argument("--load", type=float, default=0.5, help="interactive share of capacity")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--kills", action="store_true")
    parser.add_argument("--kill-lines", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--keep-logs", type=Path, help="copy the processes' logs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        await run(args, Path(tmp))


if __name__ == "__main__":
    asyncio.run(main())
