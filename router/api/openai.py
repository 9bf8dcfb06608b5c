"""The OpenAI-compatible inference endpoints."""

import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response

from router.auth import Caller
from router.deps import Deps, get_deps
from router.errors import OpenAIError, model_not_found

router = APIRouter(prefix="/v1", tags=["openai"])

DepsDep = Annotated[Deps, Depends(get_deps)]


async def _caller(deps: DepsDep, authorization: Annotated[str | None, Header()] = None) -> Caller:
    return await deps.keys.verify(authorization)


CallerDep = Annotated[Caller, Depends(_caller)]


def _parse(raw: bytes, required: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(400, "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "`model` is required and must be a string.", param="model")
    if required not in body:
        raise OpenAIError(400, f"`{required}` is required.", param=required)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(400, "`stream` must be a boolean.", param="stream")
    return body


async def _forward(deps: Deps, request: Request, path: str, required: str) -> Response:
    raw = await request.body()
    body = _parse(raw, required)
    model: str = body["model"]
    if model not in deps.table.known_models and not deps.table.candidates(model):
        raise model_not_found(model)
    return await deps.proxy.forward(model, path, raw, bool(body.get("stream", False)))


@router.post("/chat/completions")
async def chat_completions(request: Request, deps: DepsDep, _: CallerDep) -> Response:
    """Chat completions, streamed (SSE) or not."""
    return await _forward(deps, request, "/v1/chat/completions", "messages")


@router.post("/completions")
async def completions(request: Request, deps: DepsDep, _: CallerDep) -> Response:
    """Text completions, streamed (SSE) or not."""
    return await _forward(deps, request, "/v1/completions", "prompt")


@router.get("/models")
async def list_models(deps: DepsDep, _: CallerDep) -> dict[str, Any]:
    """Models with at least one ready replica."""
    now = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "llmgw"}
            for m in deps.table.routable_models()
        ],
    }
