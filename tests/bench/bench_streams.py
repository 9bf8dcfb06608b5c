"""Many concurrent streams through one router process (a script: prints figures).

    .venv/bin/python -m tests.bench.bench_streams [--streams 1000] [--gap-ms 10] [--stagger]

The mock engine (tests/bench/fasthttp.py) streams ``--tokens`` tokens, one
write every ``--gap-ms``; ``--streams`` connections each run streams back to
back for ``--seconds``, from ``--client-procs`` processes: first straight to
the mock, then through the router (served as ``llmgw router`` serves it,
``python -m tests.bench.bench_router _router URL``). Printed: time to the
first token, direct and proxied (p50/p99, and what the router adds); each
stream's longest wait between two writes (what coalescing under load costs
a stream: router/forwarding/pacing.py); events relayed per second, the router's CPU
per relayed event, and its memory per open stream (resident set while the
streams run, less before, over their count).
"""

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.bench_router import SELF
from tests.bench.fasthttp import Conn, pct, request_bytes, run_loop
from tests.bench.procs import REPO, cpu_seconds, free_port, spawn, stop, wait_http

HERE = [sys.executable, "-m", "tests.bench.bench_streams"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def client(port: int, raw: bytes, conns: int, seconds: float, stagger_s: float = 0.0) -> None:
    """Streams back to back on ``conns`` connections; prints TTFTs and counts as JSON.

    ``stagger_s``: each connection starts after a random delay up to that
    (a stream's length spreads the starts evenly: requests arrive one by one,
    not all 1,000 at once at every round)."""

    async def worker(
        deadline: float, first: list[float], gaps: list[float], errors: list[int]
    ) -> None:
        c = Conn(port)
        if stagger_s:
            await asyncio.sleep(random.uniform(0, stagger_s))
        while time.perf_counter() < deadline:
            try:
                status, ttft, _ = await c.request(raw, gaps)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                errors[0] += 1
                await c.close()
                continue
            if status == 200:
                first.append(ttft)
            else:
                errors[0] += 1
        await c.close()

    async def main() -> None:
        first: list[float] = []
        gaps: list[float] = []
        errors = [0]
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(worker(deadline, first, gaps, errors) for _ in range(conns)))
        print(json.dumps({"first": first, "gaps": gaps, "errors": errors[0]}))

    run_loop(main)


def stagger_s(args: argparse.Namespace) -> float:
    return args.tokens * args.gap_ms / 1e3 if args.stagger else 0.0


def load(port: int, raw: bytes, args: argparse.Namespace) -> tuple[list[float], list[float], int]:
    """Times to the first token, each stream's longest wait between two
    writes, and the count of failed requests, from every client process."""
    per = max(1, args.streams // args.client_procs)
    children = [
        subprocess.Popen(
            [*HERE, "_client", str(port), str(per), str(args.seconds), str(stagger_s(args))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        for _ in range(args.client_procs)
    ]
    first: list[float] = []
    gaps: list[float] = []
    errors = 0
    try:
        # Every child gets its request before any is waited on: a child starts
        # once its stdin is closed, so communicate(raw) child by child would
        # run them one after the other, each with its share of the streams.
        for child in children:
            assert child.stdin is not None
            child.stdin.write(raw)
            child.stdin.close()
            child.stdin = None  # communicate() below only reads
        for child in children:
            out, _ = child.communicate(timeout=args.seconds + 120)
            result = json.loads(out)
            first += result["first"]
            gaps += result["gaps"]
            errors += result["errors"]
    finally:
        for child in children:  # one failed: the others stop loading
            if child.poll() is None:
                child.kill()
                child.wait()
    return first, gaps, errors


def run(args: argparse.Namespace) -> None:
    from llmgw.store import Store  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="llmgw-streams-"))
    store_url = f"sqlite:///{work / 'store.db'}"
    store = Store(store_url)
    store.migrate()
    key = store.create_api_key("bench")
    store.close()
    up_port, router_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        gap = str(args.gap_ms / 1e3)
        upstream = spawn(
            [*SELF, "_upstream", str(up_port), gap, str(args.tokens)],
            dict(os.environ),
            work / "upstream.log",
        )
        procs.append(upstream)
        env = dict(os.environ, LLMGW_STORE_URL=store_url, LLMGW_PORT=str(router_port))
        router = spawn([*SELF, "_router", f"http://127.0.0.1:{up_port}"], env, work / "router.log")
        procs.append(router)
        loaded = b'"routing_table_loaded":true'
        if not wait_http(router_port, "/healthz", lambda d: loaded in d, 60):
            sys.exit(f"router did not start: {(work / 'router.log').read_text()[-2000:]}")
        path = "/v1/chat/completions"
        print(
            f"{args.streams} streams of {args.tokens} tokens, {args.gap_ms} ms apart,"
            f" {args.client_procs} client procs, {args.seconds:.0f} s each"
            f"{', starts staggered' if args.stagger else ''};"
            f" {os.cpu_count()} CPUs,"
            f" load {os.getloadavg()[0]:.2f}"
        )
        direct, d_gaps, d_err = load(up_port, request_bytes(path, "none", True), args)
        rss0 = rss_bytes(router.pid)
        cpu0 = cpu_seconds(router.pid)
        sampled: list[int] = []
        raw = request_bytes(path, key, True)
        with subprocess.Popen(
            [*HERE, "_rss", str(router.pid), str(args.seconds)], stdout=subprocess.PIPE
        ) as sampler:
            proxied, p_gaps, p_err = load(router_port, raw, args)
            out, _ = sampler.communicate(timeout=30)
            sampled = json.loads(out)
        cpu = cpu_seconds(router.pid) - cpu0
        ms = 1e3
        events = len(proxied) * args.tokens
        peak = max(sampled, default=rss0)
        print(
            f"direct:  {len(direct)} streams (errors {d_err}), first token p50"
            f" {pct(direct, 0.5) * ms:.2f} ms p99 {pct(direct, 0.99) * ms:.2f} ms"
        )
        print(
            f"proxied: {len(proxied)} streams (errors {p_err}), first token p50"
            f" {pct(proxied, 0.5) * ms:.2f} ms p99 {pct(proxied, 0.99) * ms:.2f} ms"
        )
        print(
            f"  TTFT ADDED p50 {(pct(proxied, 0.5) - pct(direct, 0.5)) * ms:.2f} ms"
            f"  p99 {(pct(proxied, 0.99) - pct(direct, 0.99)) * ms:.2f} ms"
            "   (target <= 1 ms p50)"
        )
        print(
            f"  longest wait between two writes of a stream, p50/p99: direct"
            f" {pct(d_gaps, 0.5) * ms:.1f} / {pct(d_gaps, 0.99) * ms:.1f} ms,"
            f" proxied {pct(p_gaps, 0.5) * ms:.1f} / {pct(p_gaps, 0.99) * ms:.1f} ms"
        )
        print(
            f"  {events / args.seconds:,.0f} events/s relayed; router CPU {cpu:.1f} s,"
            f" {cpu / max(events, 1) * 1e6:.0f} us per relayed event"
            " (request costs included)"
        )
        print(
            f"  router RSS {rss0 / 2**20:.0f} MiB idle, {peak / 2**20:.0f} MiB peak:"
            f" {(peak - rss0) / max(args.streams, 1) / 1024:.1f} KiB"
            " per open stream"
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop(proc)
        print(f"logs in {work}")


def sample_rss(pid: int, seconds: float) -> None:
    """The router's resident set every 100 ms for ``seconds`` (JSON list)."""
    out: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.append(rss_bytes(pid))
        time.sleep(0.1)
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "_client":
            client(
                int(rest[0]), sys.stdin.buffer.read(), int(rest[1]), float(rest[2]), float(rest[3])
            )
        elif role == "_rss":
            sample_rss(int(rest[0]), float(rest[1]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=1000, help="concurrent streams")
    p.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    p.add_argument("--gap-ms", type=float, default=10.0, help="mock: between tokens")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument(
        "--stagger",
        action="store_true",
        help="start each connection after a random delay up to a stream's length",
    )
    run(p.parse_args())


if __name__ == "__main__":
    main()
