"""Engines' own Prometheus metrics, relayed by the admin API, labelled by replica.

Engines answer only the router (their key) and their node, so their
``/metrics`` is never exposed as such: ``GET /admin/engines/metrics`` fetches
every ready replica's, in parallel and bounded, and adds ``replica`` and
``model`` labels to every sample, one HELP/TYPE per metric family. An engine
that does not answer in time, or whose answer is refused (compressed, too
long: llmgw/bounded_http.py), is named in a comment line, not an error.
"""

import asyncio
import re
from typing import Annotated

import httpx
from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from llmgw.bounded_http import fetch
from llmgw.errors import UpstreamError
from router.api.admin import _admin
from router.api.deps import Deps, get_deps

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(_admin)])
DepsDep = Annotated[Deps, Depends(get_deps)]
# An engine is an untrusted byte source: its answer is read uncompressed,
# capped, and whole within FETCH_TIMEOUT_S or not at all (llmgw/bounded_http.py).
FETCH_TIMEOUT_S = 3.0
# An engine's /metrics is tens of KiB (vLLM's with many adapters, a few hundred).
MAX_METRICS_BYTES = 4 << 20
# name{labels} value [timestamp]  or  name value [timestamp]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _is_number(text: str) -> bool:
    try:
        float(text)  # also NaN, +Inf, -Inf
    except ValueError:
        return False
    return True


def relabel(text: str, labels: dict[str, str], seen_meta: set[str]) -> list[str]:
    """``text``'s samples with ``labels`` added; HELP/TYPE lines once per family."""
    extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    out: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                key = f"{parts[1]} {parts[2]}"
                if key not in seen_meta:
                    seen_meta.add(key)
                    out.append(line)
            continue
        match = _SAMPLE.match(line)
        value = (match.group(3).split() or [""])[0] if match else ""
        if match is None or not _is_number(value):
            continue  # not a sample line: dropped rather than passed on garbled
        name, existing, rest = match.groups()
        inner = existing[1:-1] if existing else ""
        merged = f"{inner},{extra}" if inner else extra
        out.append(f"{name}{{{merged}}}{rest}")
    return out


async def fetch_metrics(
    http: httpx.AsyncClient, endpoint: str, key: str, deadline_s: float = FETCH_TIMEOUT_S
) -> str:
    """One engine's ``/metrics`` text, read as from an untrusted source.

    Raises:
        EngineAnswerRefused: compressed, past ``MAX_METRICS_BYTES``, or not
            whole within ``deadline_s`` (llmgw/bounded_http.py).
        UpstreamError: an answer other than 200.
        httpx.HTTPError: no answer.
    """
    answer = await fetch(
        http, "GET", f"{endpoint}/metrics", headers={"Authorization": f"Bearer {key}"},
        max_bytes=MAX_METRICS_BYTES, deadline_s=deadline_s,
    )  # fmt: skip
    if answer.status != 200:
        raise UpstreamError(f"/metrics {answer.status}")
    return answer.text()


@router.get("/engines/metrics", response_class=PlainTextResponse)
async def engines_metrics(deps: DepsDep) -> PlainTextResponse:
    """Every ready replica's engine metrics, labelled ``replica`` and ``model``."""
    routes = [r for rs in deps.table.routes.values() for r in rs]
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as http:
        answers = await asyncio.gather(
            *(fetch_metrics(http, r.endpoint, deps.engine_key(r.replica_id)) for r in routes),
            return_exceptions=True,
        )
    lines: list[str] = []
    seen: set[str] = set()
    for route, answer in zip(routes, answers, strict=True):
        if isinstance(answer, BaseException):
            lines.append(f"# replica {route.replica_id}: no metrics ({type(answer).__name__})")
            continue
        lines += relabel(answer, {"replica": route.replica_id, "model": route.model}, seen)
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
