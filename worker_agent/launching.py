"""The waiting parts of starting a shard: ports, rendezvous points, readiness;
and the environment engines start from.

Kept apart from the activities so each can be tested without Temporal.
"""

import socket
import time
from collections.abc import Iterable, Mapping

import httpx

from llmgw.errors import EngineLaunchError
from worker_agent.engines import Endpoint, ReadyProbe

# What an engine may inherit from the agent's environment. An allow-list,
# not a deny-list: the agent's environment holds secrets under any name
# (PGPASSWORD, AWS_*, HF_TOKEN, OTEL_EXPORTER_OTLP_HEADERS, LLMGW_*...), and
# an engine needs only these. Plans add what else they decide (keys, GPUs,
# fabric, TMPDIR), and the supervisor sets HOME/USER/XDG_CACHE_HOME for the
# engine user.
ENGINE_ENV_NAMES = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "HOME",
        "USER",
        "LOGNAME",
        "LD_LIBRARY_PATH",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    }
)
ENGINE_ENV_PREFIXES = (
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "GLOO_",
    "UCX_",
    "OMP_",
    "KMP_",
    "MKL_",
    "ROCR_",
    "HIP_",
    "HSA_",
    "VLLM_",
    "SGLANG_",
    "TORCH_",
    "PYTORCH_",
    "TRITON_",
    "GGML_",
)
# Inside an allowed prefix but a credential or a setting the plan owns.
_ENGINE_ENV_DENIED_SUFFIXES = ("_KEY", "_TOKEN", "_SECRET", "_PASSWORD")


def engine_env(agent_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the agent's environment an engine (or pass-through) may see."""
    return {
        k: v
        for k, v in agent_env.items()
        if (k in ENGINE_ENV_NAMES or k.startswith(ENGINE_ENV_PREFIXES))
        and not k.endswith(_ENGINE_ENV_DENIED_SUFFIXES)
    }


def pick_port(host: str, candidates: Iterable[int], used: set[int]) -> int:
    """The first candidate port nobody holds (checked by binding it)."""
    for port in candidates:
        if port in used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As the engines bind: connections an engine on this port closed
            # linger in TIME_WAIT for a minute, and without SO_REUSEADDR they
            # would make a free port look taken (a busy node ran out of ports).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise EngineLaunchError("no free port in the agent's engine port range")


def listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_listening(endpoints: Iterable[Endpoint], poll_s: float = 0.2) -> None:
    """Block until every endpoint listens; past its bound, fail instead of hanging."""
    for ep in endpoints:
        deadline = time.monotonic() + ep.timeout_s
        while not listening(ep.host, ep.port):
            if time.monotonic() > deadline:
                raise EngineLaunchError(
                    f"rendezvous point {ep.host}:{ep.port} not listening after {ep.timeout_s:.0f}s"
                )
            time.sleep(poll_s)


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
