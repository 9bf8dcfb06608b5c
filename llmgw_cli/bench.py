"""``llmgw bench``: a load generator for the gateway or one replica.

Closed loop: ``concurrency`` workers each send a request, wait for the whole
answer, and send the next, until ``requests`` are done or ``duration_s``
has passed. Streamed answers give time to first token and inter-token
latency; output tokens come from the engine's usage report (the stream asks
for it). Aimed at the gateway with a client API key, or straight at one
replica's engine with its engine key, the two runs show what the gateway
costs.
"""

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from pydantic import BaseModel, Field

# A word llama-style tokenizers keep as one token, so prompt length is roughly
# the number of words.
PROMPT_WORD = "hello"


class BenchConfig(BaseModel):
    """What to send, how hard, for how long."""

    base_url: str = Field(description="an OpenAI-compatible base URL ending in /v1")
    key: str = Field(description="client API key (gateway) or engine key (one replica)")
    model: str
    concurrency: int = Field(default=4, ge=1)
    requests: int | None = Field(default=None, ge=1, description="stop after this many")
    duration_s: float | None = Field(default=None, gt=0, description="or after this long")
    prompt_tokens: int = Field(default=32, ge=1)
    max_tokens: int = Field(default=32, ge=1)
    stream: bool = True
    timeout_s: float = Field(default=120.0, gt=0)


@dataclass
class Sample:
    """One request's outcome."""

    ok: bool
    latency_s: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


class BenchResult(BaseModel):
    """The figures of one run (``--json`` prints this)."""

    target: str
    model: str
    stream: bool
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    requests_per_s: float
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    output_tokens: int
    output_tokens_per_s: float
    first_errors: list[str]


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0] * 1e3
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


def summarize(config: BenchConfig, samples: list[Sample], elapsed_s: float) -> BenchResult:
    """The figures of a run from its samples (pure, so it is tested alone)."""
    good = [s for s in samples if s.ok]
    ttfts = [s.ttft_s for s in good if s.ttft_s is not None]
    gaps = [g for s in good for g in s.gaps_s]
    tokens = sum(s.output_tokens for s in good)
    latencies = [s.latency_s for s in good]
    return BenchResult(
        target=config.base_url,
        model=config.model,
        stream=config.stream,
        concurrency=config.concurrency,
        requests=len(samples),
        errors=len(samples) - len(good),
        duration_s=round(elapsed_s, 3),
        requests_per_s=len(good) / elapsed_s if elapsed_s > 0 else 0.0,
        latency_p50_ms=_percentile(latencies, 50),
        latency_p99_ms=_percentile(latencies, 99),
        ttft_p50_ms=_percentile(ttfts, 50),
        ttft_p99_ms=_percentile(ttfts, 99),
        itl_p50_ms=_percentile(gaps, 50),
        itl_p99_ms=_percentile(gaps, 99),
        output_tokens=tokens,
        output_tokens_per_s=tokens / elapsed_s if elapsed_s > 0 else 0.0,
        first_errors=sorted({s.error for s in samples if not s.ok})[:5],
    )


async def _one(http: httpx.AsyncClient, config: BenchConfig) -> Sample:
    body: dict[str, object] = {
        "model": config.model,
        "messages": [{"role": "user", "content": " ".join([PROMPT_WORD] * config.prompt_tokens)}],
        "max_tokens": config.max_tokens,
        "stream": config.stream,
    }
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    began = time.perf_counter()
    try:
        if not config.stream:
            resp = await http.post("/chat/completions", json=body)
            if resp.status_code != 200:
                return Sample(
                    False, time.perf_counter() - began, error=_why(resp.status_code, resp.text)
                )
            usage = resp.json().get("usage") or {}
            return Sample(
                True,
                time.perf_counter() - began,
                output_tokens=int(usage.get("completion_tokens", 0)),
            )
        return await _streamed(http, body, began)
    except httpx.HTTPError as exc:
        return Sample(False, time.perf_counter() - began, error=f"{type(exc).__name__}: {exc}")


async def _streamed(http: httpx.AsyncClient, body: dict[str, object], began: float) -> Sample:
    sample = Sample(True, 0.0)
    last: float | None = None
    chunks = 0
    async with http.stream("POST", "/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            return Sample(False, time.perf_counter() - began, error=_why(resp.status_code, text))
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            now = time.perf_counter()
            if data.get("usage"):
                sample.output_tokens = int(data["usage"].get("completion_tokens", 0))
            if not any((c.get("delta") or {}).get("content") for c in data.get("choices") or []):
                continue
            chunks += 1
            if sample.ttft_s is None:
                sample.ttft_s = now - began
            elif last is not None:
                sample.gaps_s.append(now - last)
            last = now
    sample.latency_s = time.perf_counter() - began
    sample.output_tokens = sample.output_tokens or chunks
    return sample


def _why(status: int, text: str) -> str:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:120]
    return f"HTTP {status}: {message}"


async def run_bench(
    config: BenchConfig, progress: Callable[[int, int], None] | None = None
) -> BenchResult:
    """Run the load; ``progress(done, errors)`` is called after every request."""
    if config.requests is None and config.duration_s is None:
        config = config.model_copy(update={"requests": 100})
    samples: list[Sample] = []
    began = time.perf_counter()
    deadline = began + config.duration_s if config.duration_s else None
    started = 0

    def more() -> bool:
        nonlocal started
        if config.requests is not None and started >= config.requests:
            return False
        if deadline is not None and time.perf_counter() >= deadline:
            return False
        started += 1
        return True

    async def worker(http: httpx.AsyncClient) -> None:
        while more():
            samples.append(await _one(http, config))
            if progress is not None:
                progress(len(samples), sum(1 for s in samples if not s.ok))

    limits = httpx.Limits(
        max_connections=config.concurrency, max_keepalive_connections=config.concurrency
    )
    async with (
        httpx.AsyncClient(
            base_url=config.base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {config.key}"},
            timeout=config.timeout_s,
            limits=limits,
        ) as http,
        asyncio.TaskGroup() as workers,
    ):
        for _ in range(config.concurrency):
            workers.create_task(worker(http))
    return summarize(config, samples, time.perf_counter() - began)
