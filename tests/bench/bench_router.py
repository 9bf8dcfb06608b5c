"""Router overhead benchmark (a script, not a test): prints figures, asserts nothing.

    .venv/bin/python tests/bench/bench_router.py [--no-litellm] [--seconds 5] ...

One run, one fast mock upstream (a raw asyncio OpenAI-compatible server that
answers /v1/chat/completions at once, JSON or SSE): direct vs through the
router (served exactly as ``llmgw router`` serves it, with a static routing
table), then through LiteLLM's proxy when it installs and starts offline.

- added latency: p50/p99 of sequential requests, direct and through the proxy
  alternating on two kept-alive connections (so noise hits both alike);
- throughput: closed-loop load from client processes for a fixed time; the
  router's CPU seconds give requests per CPU-second (its ceiling on one core
  when the client and the mock share the machine);
- streams: time to the first SSE event, direct vs through the proxy;
- the same through a floor proxy (tests/bench/floor.py: the same server and
  client stack with no gateway work), to show what being a gateway costs.

Targets: p50 <= 0.5 ms and p99 <= 2 ms added, >= 2,000 requests/s per process.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.bench.fasthttp import (
    MODEL,
    TOKENS,
    Conn,
    has_module,
    interleaved,
    load,
    pct,
    request_bytes,
    run_loop,
    serve_upstream,
)
from tests.bench.floor import serve_floor
from tests.bench.litellm import LITELLM_VENV, ensure_litellm, start_litellm
from tests.bench.procs import REPO, cpu_seconds, free_port, spawn, stop, wait_http
from tests.bench.wrk import ensure_wrk, lua_script, run_wrk

SELF = [sys.executable, "-m", "tests.bench.bench_router"]


def serve_router(upstream: str) -> None:
    """``llmgw router`` with a static routing table; settings from LLMGW_*."""
    from llmgw.lifecycle import setup_logging  # noqa: PLC0415
    from llmgw.settings import RouterSettings  # noqa: PLC0415
    from llmgw.store import Store  # noqa: PLC0415
    from llmgw.types import ReplicaMemo, ReplicaPhase  # noqa: PLC0415
    from router.main import run_loop, serve  # noqa: PLC0415

    class StaticSource:
        async def replicas(self) -> list[ReplicaMemo]:
            return [
                ReplicaMemo(
                    replica_id="bench-0", model=MODEL, phase=ReplicaPhase.READY, endpoint=upstream
                )
            ]

    # What router.main.main does, with the static table for Temporal's.
    settings = RouterSettings()
    setup_logging(settings.log_level, "router")
    store = Store(settings.resolved_store_url())
    store.migrate()
    run_loop(serve(settings, store, StaticSource()))


@dataclass
class Throughput:
    rps: float
    errors: int
    p50_ms: float
    p99_ms: float
    cpu_s: float


def throughput(
    port: int, raw: bytes, procs: int, conns: int, seconds: float, pid: int
) -> Throughput:
    cpu0 = cpu_seconds(pid)
    started = time.perf_counter()
    children = [
        subprocess.Popen(
            [*SELF, "_load", str(port), str(conns), str(seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        for _ in range(procs)
    ]
    results = []
    for child in children:
        out, _ = child.communicate(raw, timeout=seconds + 60)
        results.append(json.loads(out))
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds(pid) - cpu0
    lat = [x for r in results for x in r["lat"]]
    ok = sum(r["ok"] for r in results)
    return Throughput(
        ok / seconds,
        sum(r["errors"] for r in results),
        pct(lat, 0.5) * 1e3,
        pct(lat, 0.99) * 1e3,
        cpu * seconds / elapsed,  # CPU spent inside the load window, roughly
    )


@dataclass
class Target:
    name: str
    port: int
    key: str
    pid: int


def measure(target: Target, up_port: int, args: argparse.Namespace, work: Path) -> list[str]:
    path = "/v1/chat/completions"
    direct = request_bytes(path, "none", False)
    proxied = request_bytes(path, target.key, False)
    cpu0 = cpu_seconds(target.pid)
    seq = run_loop(lambda: interleaved(direct, up_port, proxied, target.port, args.requests))
    cpu1 = cpu_seconds(target.pid)
    streams = run_loop(
        lambda: interleaved(
            request_bytes(path, "none", True),
            up_port,
            request_bytes(path, target.key, True),
            target.port,
            args.streams,
        )
    )
    cpu2 = cpu_seconds(target.pid)
    long_ = long_streams(target, args)
    load_ = throughput(
        target.port, proxied, args.client_procs, args.conns, args.seconds, target.pid
    )
    outside = measure_wrk(target, up_port, args, work) if args.wrk_seconds > 0 else []
    ms = 1e3
    # Warm-up requests were served too: count them in the CPU per request.
    per_request = (cpu1 - cpu0) / (args.requests + args.requests // 10) * 1e6
    per_stream = (cpu2 - cpu1) / (args.streams + args.streams // 10) * 1e6
    return [
        f"== {target.name}",
        f"sequential requests: {len(seq.proxied_total)} (errors {seq.errors})",
        f"  direct  p50 {pct(seq.direct_total, 0.5) * ms:.3f} ms  p99 {pct(seq.direct_total, 0.99) * ms:.3f} ms",  # noqa: E501
        f"  proxied p50 {pct(seq.proxied_total, 0.5) * ms:.3f} ms  p99 {pct(seq.proxied_total, 0.99) * ms:.3f} ms",  # noqa: E501
        f"  ADDED   p50 {(pct(seq.proxied_total, 0.5) - pct(seq.direct_total, 0.5)) * ms:.3f} ms"
        f"  p99 {(pct(seq.proxied_total, 0.99) - pct(seq.direct_total, 0.99)) * ms:.3f} ms"
        "   (target <= 0.5 / 2 ms)",
        f"  proxy process CPU per request {per_request:.0f} us",
        f"streams: {len(streams.proxied_first)} (errors {streams.errors}), time to first event",
        f"  direct  p50 {pct(streams.direct_first, 0.5) * ms:.3f} ms  p99 {pct(streams.direct_first, 0.99) * ms:.3f} ms",  # noqa: E501
        f"  proxied p50 {pct(streams.proxied_first, 0.5) * ms:.3f} ms  p99 {pct(streams.proxied_first, 0.99) * ms:.3f} ms",  # noqa: E501
        f"  TTFT ADDED p50 {(pct(streams.proxied_first, 0.5) - pct(streams.direct_first, 0.5)) * ms:.3f} ms"  # noqa: E501
        f"  p99 {(pct(streams.proxied_first, 0.99) - pct(streams.direct_first, 0.99)) * ms:.3f} ms",
        f"  proxy process CPU per stream ({TOKENS} upstream writes) {per_stream:.0f} us,"
        f" ~{(per_stream - per_request) / (TOKENS - 1):.0f} us per event beyond a request's",
        f"long streams: {args.long_streams} sequential of {args.long_tokens} tokens"
        f" ({args.token_gap_ms} ms apart, one upstream write each)",
        f"  proxy process CPU per relayed event {long_:.1f} us (request included)"
        "   (target <= 60 us)",
        f"load: {args.client_procs} client procs x {args.conns} conns, {args.seconds:.0f} s",
        f"  {load_.rps:,.0f} requests/s (errors {load_.errors}), latency p50 {load_.p50_ms:.2f} ms"
        f" p99 {load_.p99_ms:.2f} ms   (target >= 2,000/s)",
        f"  proxy process CPU {load_.cpu_s:.2f} s in {args.seconds:.0f} s ->"
        f" {load_.rps * args.seconds / max(load_.cpu_s, 1e-9):,.0f} requests per CPU-second",
        *outside,
    ]


def long_streams(target: Target, args: argparse.Namespace) -> float:
    """The proxy's CPU per relayed event over sequential streams of many events
    (a stream's own cost spread thin): microseconds."""
    if args.long_streams <= 0:
        return float("nan")
    raw = request_bytes("/v1/chat/completions", target.key, True, args.long_tokens)
    events: int = args.long_streams * args.long_tokens

    async def run() -> float:
        conn = Conn(target.port)
        await conn.request(raw)  # warm-up
        cpu0 = cpu_seconds(target.pid)
        for _ in range(args.long_streams):
            await conn.request(raw)
        cpu = cpu_seconds(target.pid) - cpu0
        await conn.close()
        return cpu / events * 1e6

    return run_loop(run)


def measure_wrk(target: Target, up_port: int, args: argparse.Namespace, work: Path) -> list[str]:
    """The same figures from outside: wrk, sequential (1 connection) then 64 connections."""
    exe, why = ensure_wrk()
    if exe is None:
        return [f"  wrk: not measured, {why}"]
    path = "/v1/chat/completions"
    direct = lua_script(request_bytes(path, "none", False), work)
    proxied = lua_script(request_bytes(path, target.key, False), work)
    secs = args.wrk_seconds
    d = run_wrk(exe, f"http://127.0.0.1:{up_port}{path}", direct, 1, 1, secs)
    p = run_wrk(exe, f"http://127.0.0.1:{target.port}{path}", proxied, 1, 1, secs)
    cpu0 = cpu_seconds(target.pid)
    t0 = time.perf_counter()
    c = run_wrk(exe, f"http://127.0.0.1:{target.port}{path}", proxied, 64, 2, secs)
    cpu = cpu_seconds(target.pid) - cpu0
    elapsed = time.perf_counter() - t0
    return [
        f"wrk, 1 connection, {secs:.0f} s each (errors {d.errors + p.errors})",
        f"  direct  p50 {d.p50_ms:.3f} ms  p99 {d.p99_ms:.3f} ms",
        f"  proxied p50 {p.p50_ms:.3f} ms  p99 {p.p99_ms:.3f} ms",
        f"  ADDED   p50 {p.p50_ms - d.p50_ms:.3f} ms  p99 {p.p99_ms - d.p99_ms:.3f} ms"
        "   (target <= 0.5 / 2 ms)",
        f"wrk, 64 connections, 2 threads, {secs:.0f} s: {c.rps:,.0f} requests/s"
        f" (errors {c.errors}), p50 {c.p50_ms:.2f} ms p99 {c.p99_ms:.2f} ms",
        f"  proxy process CPU {cpu:.2f} s in {elapsed:.1f} s ->"
        f" {c.requests / max(cpu, 1e-9):,.0f} requests per CPU-second   (target >= 2,500)",
    ]


def client_cost(up_port: int, n: int) -> list[str]:
    """CPU per request of the upstream HTTP client alone, sequential, against the mock.

    The router's clients (router.forwarding.upstream_raw, the default; router.forwarding.upstream's
    aiohttp, the one before), and httpx, used before that, on the same requests.
    """
    import httpx  # noqa: PLC0415

    from router.forwarding.upstream import AiohttpUpstream, Upstream  # noqa: PLC0415
    from router.forwarding.upstream_raw import RawUpstream  # noqa: PLC0415

    url = f"http://127.0.0.1:{up_port}/v1/chat/completions"
    body = request_bytes("/", "x", False).split(b"\r\n\r\n", 1)[1]
    headers = {"Authorization": "Bearer x", "Content-Type": "application/json"}

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def with_httpx() -> float:
        async with httpx.AsyncClient() as client:
            started = 0.0
            for i in range(n + n // 10):
                if i == n // 10:
                    started = cpu()
                request = client.build_request("POST", url, content=body, headers=headers)
                response = await client.send(request, stream=True)
                await response.aread()
                await response.aclose()
            return (cpu() - started) / n

    async def with_router_client(upstream: Upstream) -> float:
        started = 0.0
        for i in range(n + n // 10):
            if i == n // 10:
                started = cpu()
            response = await upstream.post(url, body, headers)
            await response.read()
            response.close()
        await upstream.aclose()
        return (cpu() - started) / n

    lines = [f"== upstream HTTP client alone ({n} sequential requests to the mock, CPU/request)"]
    raw = RawUpstream(connect_timeout_s=5, read_timeout_s=60, max_connections=64)
    aio = AiohttpUpstream(connect_timeout_s=5, read_timeout_s=60, max_connections=64)
    lines.append(
        f"  RawUpstream:               {run_loop(lambda: with_router_client(raw)) * 1e6:.0f} us"
    )
    lines.append(
        f"  AiohttpUpstream:           {run_loop(lambda: with_router_client(aio)) * 1e6:.0f} us"
    )
    lines.append(f"  httpx:                     {run_loop(with_httpx) * 1e6:.0f} us")
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):  # child processes
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "_upstream":
            serve_upstream(int(rest[0]), float(rest[1]), *(int(x) for x in rest[2:3]))
        elif role == "_router":
            serve_router(rest[0])
        elif role == "_floor":
            serve_floor(int(rest[0]), rest[1], *rest[2:3])
        elif role == "_load":
            load(int(rest[0]), sys.stdin.buffer.read(), int(rest[1]), float(rest[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="sequential requests")
    p.add_argument("--streams", type=int, default=500, help="sequential streams")
    p.add_argument("--seconds", type=float, default=5.0, help="load duration")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--conns", type=int, default=32, help="connections per client process")
    p.add_argument("--long-streams", type=int, default=10, help="sequential long streams")
    p.add_argument("--long-tokens", type=int, default=1000, help="tokens per long stream")
    p.add_argument("--token-gap-ms", type=float, default=1.0, help="mock: between stream events")
    p.add_argument("--wrk-seconds", type=float, default=5.0, help="each wrk run; 0: no wrk")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument(
        "--floors",
        default="aiohttp,raw",
        help="the floor proxy's clients, measured in turn (aiohttp, raw)",
    )
    p.add_argument(
        "--router-client",
        choices=("raw", "aiohttp"),
        default=None,
        help="the router's engine client (LLMGW_UPSTREAM_CLIENT; default: raw)",
    )
    p.add_argument("--no-litellm", action="store_true")
    p.add_argument("--litellm-venv", type=Path, default=LITELLM_VENV)
    args = p.parse_args()
    run(args)


def measure_floor(
    up_port: int, args: argparse.Namespace, work: Path, client: str
) -> subprocess.Popen[bytes]:
    """The floor proxy's figures (printed); its process, stopped."""
    port = free_port()
    floor = spawn([*SELF, "_floor", str(port), f"http://127.0.0.1:{up_port}", client],
                  dict(os.environ), work / f"floor-{client}.log")  # fmt: skip
    try:
        if wait_http(port, "/v1/models", lambda d: True, 30):
            name = (
                f"floor: raw ASGI + {'RawUpstream' if client == 'raw' else client}, no gateway work"
            )
            for line in measure(Target(name, port, "-", floor.pid), up_port, args, work):
                print(line, flush=True)
    finally:
        stop(floor)
    return floor


def run(args: argparse.Namespace) -> None:
    from llmgw.store import Store  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    store_url = f"sqlite:///{work / 'store.db'}"
    store = Store(store_url)
    store.migrate()
    key = store.create_api_key("bench")
    store.close()
    up_port, router_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        upstream = spawn(
            [*SELF, "_upstream", str(up_port), str(args.token_gap_ms / 1e3)],
            dict(os.environ), work / "upstream.log",
        )  # fmt: skip
        procs.append(upstream)
        env = dict(os.environ, LLMGW_STORE_URL=store_url, LLMGW_PORT=str(router_port))
        if args.router_client:
            env["LLMGW_UPSTREAM_CLIENT"] = args.router_client
        router_client = env.get("LLMGW_UPSTREAM_CLIENT", "raw")
        router = spawn([*SELF, "_router", f"http://127.0.0.1:{up_port}"],
                       env, work / "router.log")  # fmt: skip
        procs.append(router)
        loaded = b'"routing_table_loaded":true'
        if not wait_http(router_port, "/healthz", lambda d: loaded in d, 60):
            sys.exit(f"router did not start: {(work / 'router.log').read_text()[-2000:]}")
        print(f"python {sys.version.split()[0]}, uvloop {'yes' if has_module('uvloop') else 'no'}, "
              f"httptools {'yes' if has_module('httptools') else 'no'}, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
        gap = args.token_gap_ms
        print(f"mock upstream: {TOKENS} tokens, streamed one write each, {gap} ms apart")
        plain = request_bytes("/v1/chat/completions", "none", False)
        baseline = throughput(
            up_port, plain, args.client_procs, args.conns, args.seconds, upstream.pid
        )
        print(f"== mock upstream alone: {baseline.rps:,.0f} requests/s"
              f" (p50 {baseline.p50_ms:.2f} ms), the ceiling of what follows")  # fmt: skip
        llmgw = Target(
            f"llmgw router (engine client: {router_client})", router_port, key, router.pid
        )
        for line in measure(llmgw, up_port, args, work):
            print(line, flush=True)
        stop(router)
        if not args.no_floor:
            procs.extend(measure_floor(up_port, args, work, c) for c in args.floors.split(","))
        for line in client_cost(up_port, args.requests):
            print(line, flush=True)
        if args.no_litellm:
            return
        exe, why = ensure_litellm(args.litellm_venv)
        if exe is None:
            print(f"== LiteLLM proxy: not measured, {why}")
            return
        litellm, port, why = start_litellm(exe, up_port, work, work / "litellm.log")
        if litellm is None:
            print(f"== LiteLLM proxy: not measured, {why}")
            return
        procs.append(litellm)
        target = Target("LiteLLM proxy (1 worker)", port, "sk-bench-litellm", litellm.pid)
        for line in measure(target, up_port, args, work):
            print(line, flush=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop(proc)
        print(f"logs in {work}")


if __name__ == "__main__":
    main()
