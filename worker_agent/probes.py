"""Asking a running engine over HTTP: does it serve yet, how busy is it, is it alive.

Kept apart from the activities so each can be tested without Temporal.
"""

import asyncio
from dataclasses import dataclass

import httpx

from llmgw.bounded_http import Answer, fetch
from llmgw.errors import EngineAnswerRefused
from worker_agent.engines import ReadyProbe
from worker_agent.liveness import Observation

# An engine is an untrusted byte source (llmgw/bounded_http.py): every answer
# read here is uncompressed, capped and read within a deadline in all.
# A readiness, drain or load check's deadline for each request (httpx's
# timeouts bound each read alone: a trickling answer outlasts them).
CHECK_DEADLINE_S = 10.0
# The readiness completion: one token, from an engine that may still be warming up.
COMPLETION_DEADLINE_S = 60.0
# Answers whose status alone is read (/health, the probe completion): their start kept.
_STATUS_ONLY_BYTES = 64 << 10
# A model listing (adapters included) or a vLLM /metrics: tens of KiB.
_LISTING_BYTES = 4 << 20
# llama.cpp's /slots: each slot's parameters, a few KiB each.
_SLOTS_BYTES = 8 << 20


async def probe_ready(
    http: httpx.AsyncClient,
    endpoint: str,
    key: str,
    model: str,
    probe: ReadyProbe,
    deadline_s: float = CHECK_DEADLINE_S,
) -> tuple[list[str] | None, str]:
    """Up, weights loaded, and able to generate: the model ids, or why not yet.

    ``deadline_s``: the most each of its requests may take, answer read
    (the completion has ``COMPLETION_DEADLINE_S``, or ``deadline_s`` if more)."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        health = await fetch(
            http, "GET", f"{endpoint}{probe.health_path}", headers=headers,
            max_bytes=_STATUS_ONLY_BYTES, deadline_s=deadline_s, truncate=True,
        )  # fmt: skip
        if health.status != 200:
            return None, f"{probe.health_path} {health.status}"
        models = await fetch(
            http, "GET", f"{endpoint}{probe.models_path}", headers=headers,
            max_bytes=_LISTING_BYTES, deadline_s=deadline_s,
        )  # fmt: skip
        if models.status != 200:
            return None, f"{probe.models_path} {models.status}"
        ids = [str(m["id"]) for m in models.json().get("data", [])]
        if not ids:
            return None, "no model listed"
        if probe.completion is not None:
            # /health can answer 200 from an engine that dies on its first
            # generation: ready means it generated once.
            gen = await fetch(
                http, "POST", f"{endpoint}{probe.completion.path}", headers=headers,
                json_body=probe.completion.body(model), max_bytes=_STATUS_ONLY_BYTES,
                deadline_s=max(deadline_s, COMPLETION_DEADLINE_S), truncate=True,
            )  # fmt: skip
            if gen.status != 200:
                return None, f"probe completion {gen.status}"
    except (
        httpx.HTTPError, EngineAnswerRefused, ValueError, KeyError, TypeError, AttributeError
    ) as exc:  # fmt: skip
        return None, f"{type(exc).__name__}: {exc}"
    return ids, "ready"


async def engine_load(
    http: httpx.AsyncClient,
    endpoint: str,
    key: str,
    engine: str,
    deadline_s: float = CHECK_DEADLINE_S,
) -> tuple[float | None, str]:
    """How many requests the engine is working on (None: it cannot tell us,
    or its answer was refused: never a guess, a drain takes 0 as idle)."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if engine == "llama.cpp":
            slots = await _get(http, f"{endpoint}/slots", headers, _SLOTS_BYTES, deadline_s)
            busy = sum(1 for s in slots.json() if s.get("is_processing"))
            return float(busy), f"{busy} slots processing"
        if engine == "vllm":
            metrics = await _get(http, f"{endpoint}/metrics", headers, _LISTING_BYTES, deadline_s)
            text = metrics.text()
            running = _metric_sum(text, "vllm:num_requests_running")
            waiting = _metric_sum(text, "vllm:num_requests_waiting")
            return running + waiting, f"{running:g} running, {waiting:g} waiting"
    except (
        httpx.HTTPError, EngineAnswerRefused, ValueError, AttributeError, TypeError, IndexError
    ) as exc:  # fmt: skip
        return None, f"{type(exc).__name__}: {exc}"
    return None, f"{engine} reports no in-flight count"


async def _get(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], max_bytes: int, deadline_s: float
) -> Answer:
    """GET ``url`` whole (refused past ``max_bytes``); its status must be 200."""
    answer = await fetch(
        http, "GET", url, headers=headers, max_bytes=max_bytes, deadline_s=deadline_s
    )
    if answer.status != 200:
        raise ValueError(f"{httpx.URL(url).path} {answer.status}")
    return answer


async def engine_busy(
    http: httpx.AsyncClient,
    endpoint: str,
    key: str,
    engine: str,
    deadline_s: float = CHECK_DEADLINE_S,
) -> tuple[bool | None, str]:
    """Whether the engine is working on requests (None: it cannot tell us)."""
    load, detail = await engine_load(http, endpoint, key, engine, deadline_s)
    return (None if load is None else load > 0), detail


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class LivenessProbe:
    """How to ask one engine kind whether it still serves (worker_agent/liveness.py).

    ``path`` must go through the engine's work loop, not only its HTTP
    thread: llama.cpp answers ``/health`` while its task loop is wedged.
    Where ``path`` is Prometheus text, ``in_flight`` names the gauges summed
    into the requests it works on and ``progress`` the counters summed into
    a figure that grows while it works (empty: not read). An engine that
    does not offer ``path`` (404, 501: llama-server without ``--metrics``,
    an SGLang before ``/health_generate``) is asked ``fallback_path`` in the
    same round instead: less telling, but never a healthy engine taken for
    a hung one.
    """

    path: str = "/health"
    in_flight: tuple[str, ...] = ()
    progress: tuple[str, ...] = ()
    fallback_path: str = "/health"


# Per engine kind (ShardRecord.engine). Checked against:
#
# * llama.cpp (the wheel and the portable server, both run by
#   tests/agent/test_liveness_engine.py): ``/metrics`` (the plan passes
#   ``--metrics``) is answered by the task loop, as ``/slots`` is.
#   ``llamacpp:n_decode_total`` counts llama_decode calls: one per batch of
#   prompt (``--batch-size`` tokens, 2048 by default) during a prefill and
#   one per token while decoding, so it moves through a long prompt too; a
#   single batch of a big model on a slow device is the longest it stands
#   still with work in flight.
# * vLLM 0.32 (vllm/v1/metrics/loggers.py): ``/metrics`` is served by the API
#   server process, so it answers while the engine core hangs; the stall
#   rule catches that. ``vllm:prompt_tokens_total`` grows when a request's
#   prefill completes (chunked prefills count at their end),
#   ``vllm:generation_tokens_total`` with each step: one long prefill is
#   the longest the figure stands still (the reason ``stall_s`` is long).
# * SGLang (docs.sglang.io, not run here): metrics only with
#   ``--enable-metrics``, which the plan does not pass, so ``/metrics``
#   would answer 404. ``/health_generate`` sends the scheduler a one-token
#   request (answered at once while it produces output) and fails when the
#   scheduler does not answer: it judges progress itself.
# What an engine answers for a path it does not serve (llama-server: 501
# for /metrics without --metrics).
_NOT_OFFERED = frozenset({404, 501})

LIVENESS_PROBES: dict[str, LivenessProbe] = {
    "llama.cpp": LivenessProbe(
        path="/metrics",
        in_flight=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
        progress=("llamacpp:n_decode_total",),
    ),
    "vllm": LivenessProbe(
        path="/metrics",
        in_flight=("vllm:num_requests_running", "vllm:num_requests_waiting"),
        progress=("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    ),
    "sglang": LivenessProbe(path="/health_generate"),
}


def liveness_probe(engine: str) -> LivenessProbe:
    """The probe for ``engine`` (a ShardRecord's engine); ``/health`` for one not listed."""
    return LIVENESS_PROBES.get(engine, LivenessProbe())


async def probe_liveness(
    http: httpx.AsyncClient, endpoint: str, key: str, probe: LivenessProbe, timeout_s: float
) -> Observation:
    """One liveness round: never longer than ``timeout_s``, never raises for the engine's sake."""
    headers = {"Authorization": f"Bearer {key}"}
    path = probe.path
    try:
        # Each request is bounded by itself (llmgw/bounded_http.py); with the
        # fallback two of them make a round, and the round is what is bounded.
        async with asyncio.timeout(timeout_s):
            answer = await _get_bounded(http, f"{endpoint}{path}", headers, timeout_s)
            if answer.status in _NOT_OFFERED and probe.fallback_path != path:
                path = probe.fallback_path
                answer = await _get_bounded(http, f"{endpoint}{path}", headers, timeout_s)
    except TimeoutError:
        return Observation(answered=False, why=f"no answer within {timeout_s:g}s")
    except EngineAnswerRefused as exc:
        # Compressed when asked for identity, or too slow: a hostile or a
        # broken engine, unanswered either way.
        return Observation(answered=False, why=str(exc)[:200])
    except httpx.HTTPError as exc:
        return Observation(answered=False, why=f"{type(exc).__name__}: {exc}"[:200])
    if answer.status != 200:
        return Observation(answered=False, why=f"{path} {answer.status}")
    if path != probe.path or (not probe.in_flight and not probe.progress):
        return Observation(answered=True)
    values = metric_values(answer.text())
    return Observation(
        answered=True,
        in_flight=_summed(values, probe.in_flight),
        progress=_summed(values, probe.progress),
    )


# The most of an answer a liveness round reads: an engine's /metrics is tens
# of KiB; one that sends more (a bug, or an engine the tenant's code took
# over) costs the agent no more memory than this, counted in bytes as they
# came (never decompressed: llmgw/bounded_http.py).
_MAX_ANSWER_BYTES = 4 << 20


async def _get_bounded(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float
) -> Answer:
    """GET ``url``: the status and at most ``_MAX_ANSWER_BYTES`` of the body
    (the figures in its start are read: a long answer is still an answer)."""
    return await fetch(
        http, "GET", url, headers=headers, max_bytes=_MAX_ANSWER_BYTES,
        deadline_s=timeout_s, truncate=True,
    )  # fmt: skip


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text as name -> value, the lines of one name (its labels) summed."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        # name{labels} value [timestamp]; a label value may hold spaces.
        name, brace, rest = line.partition("{")
        rest = rest.rpartition("}")[2] if brace else name.partition(" ")[2]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        name = name.split(" ", 1)[0]
        values[name] = values.get(name, 0.0) + value
    return values


def _summed(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    """The sum of ``names``; None when any is missing (the engine does not tell)."""
    if not names or any(n not in values for n in names):
        return None
    return sum(values[n] for n in names)
