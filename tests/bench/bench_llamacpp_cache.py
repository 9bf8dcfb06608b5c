"""llama.cpp's cache under the router's defaults (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_llamacpp_cache [--configs default,slots8,sps0]
        [--conversations 13] [--turns 5] [--replicas 3] [--concurrency 3]

Issue 34, item 7. The real processes (a Temporal dev server, the control
worker, one agent, ``--replicas`` llama.cpp replicas of the generated tiny
model, one router) and the probe the issue measured: ``--conversations``
conversations sharing one system prompt, ``--turns`` turns each, a round of
every conversation's next turn at a time, ``--concurrency`` requests in
flight, through the router's default routing (prefix).

Per engine configuration (each its own replicas: ``slots`` and engine
arguments are how an engine runs): the cached fraction, the engine-reported
``cached_tokens`` over what a perfect cache could hold:

- a later turn: its whole previous turn (prompt and answer; at most its
  prompt less the one token llama.cpp always evaluates again);
- a first turn: the shared system prompt (its prompt less what its second
  turn added), except on the first conversation each replica served.

Only the ratios matter: the machine is small and shared, wall time is not
reported as a figure.
"""

import argparse
import asyncio
import itertools
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from temporalio.client import Client

from llmgw import replicas
from llmgw.store import Store
from llmgw.temporal import connect
from llmgw.types import CacheScope, EngineKind, EngineProfile, ModelSpec
from llmgw.types.model import RoutingPolicy
from llmgw_cli.dev.tinymodel import TINY, generate_model
from tests.bench.bench_batch import machine
from tests.bench.bench_prefix import text
from tests.bench.procs import stop_replicas
from tests.harness import System, free_port, start_devserver, wait_routable

MODEL = "bench-llamacpp-cache"
ADMIN = "llmgw-bench-llamacpp-cache-admin"
# At 2,048 the engine's own slots (four sharing one cache of -c cells) failed
# the fourth turns: three conversations in flight outgrew the shared cache.
CONTEXT = 4096
SYSTEM_WORDS = 120
QUESTION_WORDS = 15
MAX_TOKENS = 12

# name: (routing.slots, engine_args)
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "default": (0, []),
    "slots8": (8, []),
    "sps0": (0, ["-sps", "0"]),
    "sps0.5": (0, ["-sps", "0.5"]),
    "sps0-cram0": (0, ["-sps", "0", "--cache-ram", "0"]),
    "slots4": (4, []),
}
# What an entry that leaves slots out runs with (llmgw/types/model.py
# AUTO_SLOTS): the bench names each configuration's slots, 0 included.


@dataclass
class Turn:
    prompt: int
    cached: int
    completion: int


@dataclass
class Talk:
    messages: list[dict[str, str]]
    turns: list[Turn] = field(default_factory=list)


async def ask(http: httpx.AsyncClient, talk: Talk, question: str) -> None:
    """One turn (not streamed): its usage recorded, the answer kept in the history."""
    talk.messages.append({"role": "user", "content": question})
    body = {"model": MODEL, "messages": talk.messages, "max_tokens": MAX_TOKENS}
    r = await http.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"turn refused: {r.status_code} {r.text}")
    answer = r.json()
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    talk.turns.append(Turn(usage["prompt_tokens"], cached, usage["completion_tokens"]))
    talk.messages.append(
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
    )


def ideal(talks: list[Talk], replicas_n: int) -> int:
    """What a perfect cache could hold of these turns (the module's definition)."""
    total = 0
    firsts = []
    for talk in talks:
        t = talk.turns
        for prev, now in itertools.pairwise(t):
            total += min(now.prompt - 1, prev.prompt + prev.completion)
        if len(t) > 1:
            added = t[1].prompt - t[0].prompt - t[0].completion
            firsts.append(max(0, t[0].prompt - added))
    # The first conversation on each replica computes the system prompt.
    firsts.sort()
    return total + sum(firsts[: max(0, len(firsts) - replicas_n)])


async def probe(http: httpx.AsyncClient, args: argparse.Namespace, salt: str) -> float:
    rng = random.Random(salt)
    system = f"{salt} system prompt: " + text(rng, SYSTEM_WORDS)
    talks = [Talk([{"role": "system", "content": system}]) for _ in range(args.conversations)]
    gate = asyncio.Semaphore(args.concurrency)

    async def one(c: int, n: int) -> None:
        async with gate:
            await ask(http, talks[c], f"user {c} turn {n}: " + text(rng, QUESTION_WORDS))

    for n in range(args.turns):
        await asyncio.gather(*(one(c, n) for c in range(len(talks))))
    cached = sum(t.cached for talk in talks for t in talk.turns)
    prompt = sum(t.prompt for talk in talks for t in talk.turns)
    best = ideal(talks, args.replicas)
    print(
        f"    cached {cached:,} of {prompt:,} prompt tokens; a perfect cache {best:,};"
        f" per turn (sum over conversations): "
        + " ".join(
            f"{sum(k.turns[i].cached for k in talks)}/{sum(k.turns[i].prompt for k in talks)}"
            for i in range(args.turns)
        ),
        flush=True,
    )
    return cached / best if best else float("nan")


def spec_of(model: Path, slots: int, engine_args: list[str]) -> ModelSpec:
    return ModelSpec(
        name=MODEL,
        engine=EngineKind.LLAMA_CPP,
        source=str(model),
        context_length=CONTEXT,
        engine_args=engine_args,
        profile=EngineProfile(max_inflight=4),
        routing=RoutingPolicy(slots=slots),
        # The probe reads the engine's own cached counts, which a caller sees
        # of llama.cpp only when its cache is shared (router/affinity/scope.py).
        cache_scope=CacheScope.SHARED,
    )


async def run(args: argparse.Namespace, root: Path) -> None:
    port = free_port()
    server = start_devserver(root / "temporal.db", port, root / "temporal.log")
    system = System(f"127.0.0.1:{port}", root / "llmgw", free_port(), {"LLMGW_ADMIN_KEY": ADMIN})
    system.work_dir.mkdir()
    model = generate_model(root / "model", TINY)
    client: Client | None = None
    rids: list[str] = []
    results: dict[str, float] = {}
    try:
        client = await connect(f"127.0.0.1:{port}")
        first = spec_of(model, *CONFIGS["default"])
        key = system.catalog(first)
        system.spawn("control")
        system.spawn("agent", {"LLMGW_NODE_ID": "bench-node"})
        await replicas.wait_node_registered(client, "bench-node", 120)
        router_port = free_port()
        system.start_router(router_port)
        store = Store(system.store_url)
        print(f"machine: {machine()}")
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{router_port}",
                headers={"Authorization": f"Bearer {key}"},
                timeout=600,
            ) as http:
                for name in args.configs.split(","):
                    slots, extra = CONFIGS[name]
                    spec = spec_of(model, slots, extra)
                    await asyncio.to_thread(store.put_model, spec)
                    rids = [
                        await replicas.start_replica(client, spec) for _ in range(args.replicas)
                    ]
                    for rid in rids:
                        await replicas.wait_ready(client, rid, 600)
                    await wait_routable(f"http://127.0.0.1:{router_port}/v1", key, MODEL, 120)
                    print(f"  {name}: routing.slots {slots}, engine_args {extra}", flush=True)
                    results[name] = await probe(http, args, f"{name}/{time.time_ns()}")
                    await stop_replicas(client, rids)
                    rids = []
        finally:
            store.close()
    finally:
        await stop_replicas(client, rids)
        system.stop()
        server.stop()
    print(
        f"\n{args.conversations} conversations x {args.turns} turns, {args.replicas} replicas,"
        f" {args.concurrency} at a time; cached / what a perfect cache could hold:"
    )
    for name, fraction in results.items():
        print(f"  {name}: {fraction:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="default,slots8,sps0")
    parser.add_argument("--conversations", type=int, default=13)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=3)
    args = parser.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {sorted(CONFIGS)}")
    print(
        "command: .venv/bin/python -m tests.bench.bench_llamacpp_cache " + shlex.join(sys.argv[1:])
    )
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-llamacpp-cache-") as tmp:
        asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
