"""What the authenticating pass-through adds: per request and per streamed token.

Starts a real llama-server (the tiny generated model, one thread) on loopback with
its key, and the pass-through in front of it, then times the same requests sent
directly and through the pass-through, interleaved so that drift on a shared
machine hits both alike. Prints medians and p90s; asserts nothing.

    .venv/bin/python -m tests.bench.bench_passthrough [--requests 300] [--streams 20]
        [--close-engine-connections]
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmgw_cli.dev.tinymodel import generate_tiny_model
from llmgw_cli.procs import Child, wait_for
from worker_agent import passthrough
from worker_agent.installs.llamacpp import ensure_llama_cpp

REPO = Path(__file__).resolve().parents[2]
KEY = "llmgw-engine-bench"


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid``: steady where wall time is not (shared cores)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def _timed(http: httpx.AsyncClient, method: str, url: str, body: object) -> float:
    start = time.perf_counter()
    r = await http.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"})
    r.raise_for_status()
    return time.perf_counter() - start


async def _stream(http: httpx.AsyncClient, url: str, tokens: int) -> tuple[float, int]:
    body = {"prompt": "hi", "max_tokens": tokens, "stream": True, "temperature": 0}
    start = time.perf_counter()
    chunks = 0
    headers = {"Authorization": f"Bearer {KEY}"}
    async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    return time.perf_counter() - start, chunks


async def _measure(
    direct: str, proxied: str, requests: int, streams: int, tokens: int, front_pid: int
) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        for base in (direct, proxied):  # warm both connections and the engine
            await _timed(http, "GET", base + "/health", None)
            await _stream(http, base, 8)
        cases = [
            ("GET /health", "GET", "/health", None),
            (
                "POST /v1/completions, 1 token",
                "POST",
                "/v1/completions",
                {"prompt": "hi", "max_tokens": 1, "temperature": 0},
            ),
        ]
        for name, method, path, body in cases:
            d: list[float] = []
            p: list[float] = []
            cpu = 0.0
            for _ in range(requests):
                d.append(await _timed(http, method, direct + path, body))
                before = _cpu_s(front_pid)
                p.append(await _timed(http, method, proxied + path, body))
                cpu += _cpu_s(front_pid) - before
            md, mp = statistics.median(d), statistics.median(p)
            print(
                f"{name:32s} direct median {md * 1e3:7.3f} ms p90 {_pct(d, 0.9) * 1e3:7.3f} ms | "
                f"through pass-through median {mp * 1e3:7.3f} ms p90 {_pct(p, 0.9) * 1e3:7.3f} ms"
                f" | added {(mp - md) * 1e3:+.3f} ms per request  (n={requests} each);"
                f" pass-through CPU {cpu * 1e3 / requests:.3f} ms per request"
            )
        sd: list[float] = []
        sp: list[float] = []
        chunks = 0
        cpu = 0.0
        for _ in range(streams):
            t, chunks = await _stream(http, direct, tokens)
            sd.append(t)
            before = _cpu_s(front_pid)
            t, _ = await _stream(http, proxied, tokens)
            cpu += _cpu_s(front_pid) - before
            sp.append(t)
        md, mp = statistics.median(sd), statistics.median(sp)
        print(
            f"stream of {chunks} tokens            direct median {md * 1e3:7.1f} ms | "
            f"through pass-through median {mp * 1e3:7.1f} ms | added "
            f"{(mp - md) * 1e6 / max(chunks, 1):+.1f} us per streamed token (n={streams} each);"
            f" pass-through CPU {cpu * 1e6 / (streams * max(chunks, 1)):.1f} us per streamed token"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        passthrough.CLOSE_FLAG,
        action="store_true",
        help="a connection to the engine per request, as llama.cpp's pass-throughs run",
    )
    args = parser.parse_args()
    llama = ensure_llama_cpp(REPO / ".llmgw" / "engines")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        tiny = generate_tiny_model(Path(tmp))
        engine_port, front_port = _free_port(), _free_port()
        env = llama.environment({**os.environ, "LLAMA_API_KEY": KEY})
        argv = [
            str(llama.server), "--model", str(tiny.model_path), "--host", "127.0.0.1",
            "--port", str(engine_port), "--threads", "1", "--ctx-size", "2048", "--no-webui",
        ]  # fmt: skip
        engine = Child("llama-server", argv, env, Path(tmp) / "engine.log")
        front_env = {**os.environ, passthrough.KEY_ENV: KEY}
        front_argv = passthrough.command(
            sys.executable, "127.0.0.1", front_port, f"http://127.0.0.1:{engine_port}",
            close_engine_connections=args.close_engine_connections,
        )  # fmt: skip
        front = Child("passthrough", front_argv, front_env, Path(tmp) / "front.log")
        try:
            up = wait_for(lambda: _healthy(front_port) and _healthy(engine_port), 60)
            if not up:
                print(engine.log_tail(), front.log_tail(), file=sys.stderr)
                return 1
            asyncio.run(
                _measure(
                    f"http://127.0.0.1:{engine_port}",
                    f"http://127.0.0.1:{front_port}",
                    args.requests,
                    args.streams,
                    args.tokens,
                    front.pid,
                )
            )
        finally:
            front.stop()
            engine.stop()
    return 0


def _healthy(port: int) -> bool:
    try:
        r = httpx.get(
            f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=1
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


if __name__ == "__main__":
    raise SystemExit(main())
