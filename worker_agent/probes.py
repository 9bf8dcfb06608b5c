"""Asking a running engine over HTTP: does it serve yet, how busy is it.

Kept apart from the activities so each can be tested without Temporal.
"""

import httpx

from worker_agent.engines import ReadyProbe


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
