"""Issue 23 item 13: a wake from zero answers every request waiting on it
together (one request in a few was answered ~5 s after the others).

The 5 s was llama-server's keep-alive: its HTTP server (cpp-httplib) keeps
a thread with each kept-alive connection until it sends again or 5 s pass,
and starts another only when none is idle as a connection is queued. A wake
dispatches every waiting request at once; the pass-through opened an engine
connection for each and kept them alive, and now and then one was queued
behind those idle connections. The pass-through now closes its engine
connection after each answer (tests/agent/test_passthrough_keepalive.py
makes the race certain with a one-thread stand-in).

Here the whole path, as the issue measured it: twenty concurrent requests
(half streamed) on a model at zero, woken six times in a row, through the
real router, control worker, agent and llama.cpp; the last answer of each
wake comes right after the first. On the old pass-through about one wake in
five (measured on a two-core machine) had requests held back ~5 s.
"""

import asyncio
import time

import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.types import (
    AutoscalePolicy,
    DeploymentStatus,
    EngineProfile,
    ModelSpec,
    QueuePolicy,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import FAST, System, wait_deployment

WAKES = 6
REQUESTS = 20
# The spread allowed between a wake's first and last answer: twenty short
# requests take a fraction of a second; one held back took the engine's 5 s.
SPREAD_S = 3.0


def _ready(status: DeploymentStatus) -> int:
    return sum(s.ready for s in status.slots)


async def _timed(oai: openai.AsyncOpenAI, model: str, i: int) -> float:
    """One request (streamed when ``i`` is odd); when it was answered in full."""
    if i % 2:
        stream = await oai.completions.create(
            model=model, prompt=f"n {i}", max_tokens=4, stream=True
        )
        async for _ in stream:
            pass
    else:
        await oai.completions.create(model=model, prompt=f"n {i}", max_tokens=4)
    return time.monotonic()


@pytest.mark.timeout(900)
async def test_a_wake_answers_every_waiting_request_together(
    system: System, client: Client, tiny: TinyModel
) -> None:
    policy = AutoscalePolicy(min_replicas=0, max_replicas=2, idle_timeout_s=2)
    spec = ModelSpec(
        name="tiny-wake-latency",
        source=str(tiny.model_path),
        context_length=2048,
        profile=EngineProfile(max_inflight=0),  # a wake dispatches every request at once
        autoscale=policy,
        queue=QueuePolicy(max_waiting=64, max_wait_s=150),
    )
    key = system.catalog(spec)
    started = await system.start(client, "wake-latency-node")
    await replicas.apply_deployment(client, spec, 1, timeouts=FAST)
    await wait_deployment(client, spec.name, lambda s: _ready(s) == 1, 240)
    oai = openai.AsyncOpenAI(base_url=started.base, api_key=key, max_retries=0, timeout=300)
    spreads: list[float] = []
    try:
        for _ in range(WAKES):
            await wait_deployment(client, spec.name, lambda s: s.desired == 0 and not s.slots, 240)
            sent = time.monotonic()
            done = await asyncio.gather(*(_timed(oai, spec.name, i) for i in range(REQUESTS)))
            first = min(done)
            spreads.append(max(done) - first)
            print(
                f"wake: first answer {first - sent:.2f} s after sending,"
                f" answers at +{sorted(round(t - first, 2) for t in done)}"
            )
    finally:
        await oai.close()
    assert all(s < SPREAD_S for s in spreads), spreads
    await replicas.remove_deployment(client, spec, 60)
