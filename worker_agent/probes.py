"""Asking a running engine over HTTP: does it serve yet, how busy is it, is it alive.

Kept apart from the activities so each can be tested without Temporal.
"""

import asyncio
from dataclasses import dataclass

import httpx

from worker_agent.engines import ReadyProbe
from worker_agent.liveness import Observation


async def probe_ready(
    http: httpx.AsyncClient, endpoint: str, key: str, model: str, probe: ReadyProbe
) -> tuple[list[str] | None, str]:
    """Up, weights loaded, and able to generate: the model ids, or why not yet."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        health = await http.get(f"{endpoint}{probe.health_path}", headers=headers)
        if health.status_code != 200:
            return None, f"{probe.health_path} {health.status_code}"
        models = await http.get(f"{endpoint}{probe.models_path}", headers=headers)
        if models.status_code != 200:
            return None, f"{probe.models_path} {models.status_code}"
        ids = [m["id"] for m in models.json().get("data", [])]
        if not ids:
            return None, "no model listed"
        if probe.completion is not None:
            # /health can answer 200 from an engine that dies on its first
            # generation: ready means it generated once.
            gen = await http.post(
                f"{endpoint}{probe.completion.path}",
                json=probe.completion.body(model),
                headers=headers,
                timeout=60.0,
            )
            if gen.status_code != 200:
                return None, f"probe completion {gen.status_code}"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return ids, "ready"


async def engine_load(
    http: httpx.AsyncClient, endpoint: str, key: str, engine: str
) -> tuple[float | None, str]:
    """How many requests the engine is working on (None: it cannot tell us)."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if engine == "llama.cpp":
            slots = (await http.get(f"{endpoint}/slots", headers=headers)).json()
            busy = sum(1 for s in slots if s.get("is_processing"))
            return float(busy), f"{busy} slots processing"
        if engine == "vllm":
            text = (await http.get(f"{endpoint}/metrics", headers=headers)).text
            running = _metric_sum(text, "vllm:num_requests_running")
            waiting = _metric_sum(text, "vllm:num_requests_waiting")
            return running + waiting, f"{running:g} running, {waiting:g} waiting"
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return None, f"{engine} reports no in-flight count"


async def engine_busy(
    http: httpx.AsyncClient, endpoint: str, key: str, engine: str
) -> tuple[bool | None, str]:
    """Whether the engine is working on requests (None: it cannot tell us)."""
    load, detail = await engine_load(http, endpoint, key, engine)
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
        # httpx bounds each phase (connect, each read) by itself; a reply
        # trickling in could outlast them together: the whole round is bounded.
        async with asyncio.timeout(timeout_s):
            status, body = await _get_bounded(http, f"{endpoint}{path}", headers, timeout_s)
            if status in _NOT_OFFERED and probe.fallback_path != path:
                path = probe.fallback_path
                status, body = await _get_bounded(http, f"{endpoint}{path}", headers, timeout_s)
    except TimeoutError:
        return Observation(answered=False, why=f"no answer within {timeout_s:g}s")
    except httpx.HTTPError as exc:
        return Observation(answered=False, why=f"{type(exc).__name__}: {exc}"[:200])
    if status != 200:
        return Observation(answered=False, why=f"{path} {status}")
    if path != probe.path or (not probe.in_flight and not probe.progress):
        return Observation(answered=True)
    values = metric_values(body.decode(errors="replace"))
    return Observation(
        answered=True,
        in_flight=_summed(values, probe.in_flight),
        progress=_summed(values, probe.progress),
    )


# The most of an answer a liveness round reads: an engine's /metrics is tens
# of KiB; one that sends more (a bug, or an engine the tenant's code took
# over) costs the agent no more memory than this.
_MAX_ANSWER_BYTES = 4 << 20


async def _get_bounded(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float
) -> tuple[int, bytes]:
    """GET ``url``: the status and at most ``_MAX_ANSWER_BYTES`` of the body."""
    async with http.stream("GET", url, headers=headers, timeout=timeout_s) as answer:
        body = bytearray()
        async for chunk in answer.aiter_bytes():
            body += chunk
            if len(body) >= _MAX_ANSWER_BYTES:
                del body[_MAX_ANSWER_BYTES:]
                break
        return answer.status_code, bytes(body)


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
