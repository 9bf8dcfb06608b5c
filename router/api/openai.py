"""The OpenAI-compatible inference endpoints.

Only these paths reach an engine (the allow-list): chat completions,
completions and embeddings. Nothing else of the engine's API (``/metrics``,
``/slots``, ``/props``, ``/tokenize``, LoRA and weight endpoints,
``/invocations``, ``/pause`` ...) is routed: the router has no route for it.
"""

import contextlib
import json
import time
from collections.abc import Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Header, Request
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.trace import Span, SpanKind
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.routing import Route as HttpRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from llmgw.types import AdapterSpec, EngineKind, ModelSpec, RoutingPolicyKind
from router.affinity.chunks import PromptKey, prompt_key
from router.affinity.policy import DEFAULT_ROUTING
from router.affinity.scope import SALT_FIELD, scope_of
from router.api.auth import Caller, exec_allowed
from router.api.deps import Deps, get_deps
from router.api.media import check_media
from router.api.reservation import (
    DEFAULT_COMPLETION_RESERVE,
    Body,
    bounded,
    estimate,
    reserved_tokens,
)
from router.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    _Generation,
    queue_cost,
)
from router.billing.accounting import RequestOutcome
from router.billing.bill import RequestBill, end_span
from router.billing.quotas import QuotaRejection
from router.common.disconnect import disconnected
from router.common.errors import (
    QUOTA_EXCEEDED,
    ErrorKind,
    OpenAIError,
    invalid_body,
    invalid_fields,
)
from router.common.metrics import OTHER_ROUTE
from router.control_link.adapters import base_body
from router.control_link.routing import Route
from router.forwarding.call import Call
from router.forwarding.proxy import StaleAdapter
from router.forwarding.relay import Reply, StreamReply

# Reusable: entering and leaving it does nothing.
_NO_SPAN = contextlib.nullcontext()

router = APIRouter(prefix="/v1", tags=["openai"])

DepsDep = Annotated[Deps, Depends(get_deps)]


# A client's conversation id (any string): its requests share a sticky key for
# cache-aware routing (docs/guides/routing.md), scoped to the calling key. The
# Responses API sends ``resp:<first response of the chain>`` in it.
SESSION_HEADER = "x-llmgw-session"
_SESSION_NAME = SESSION_HEADER.encode()  # as ASGI gives header names
# The longest session value kept (the rest is cut: it is only a key).
MAX_SESSION_CHARS = 256

# The Authorization header is read by hand (not declared as an API parameter).
AuthHeader = Annotated[str | None, Header(include_in_schema=False)]


async def _caller(request: Request, deps: DepsDep, authorization: AuthHeader = None) -> Caller:
    try:
        caller = await deps.keys.verify(authorization, request.headers.get)
        if caller.exec and not exec_allowed(request.method, route_template(request)):
            raise ErrorKind.EXEC_NOT_ALLOWED.error()
        return caller
    except OpenAIError as exc:
        _refused(deps, route_template(request), exc)
        raise


def route_template(request: Request) -> str:
    """The matched route's path template (``/v1/files/{file_id}``), never the
    request's path: a label taken from the path made one series per path a
    client made up, each kept for good (router memory without bound)."""
    path = getattr(request.scope.get("route"), "path", None)
    return path if isinstance(path, str) else OTHER_ROUTE


def _refused(deps: Deps, path: str, exc: OpenAIError) -> None:
    # Counted before the model is known to exist: no model label (it is the
    # client's free text), and the path is one of this router's own route
    # templates (a few dozen), and the status one of the error table's.
    deps.metrics.requests.labels(path.removeprefix("/v1/"), "", str(exc.status)).inc()


CallerDep = Annotated[Caller, Depends(_caller)]


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (``name`` in lower case, as ASGI servers give them)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body, or 413 once it passes ``limit`` bytes (499 if the client left)."""
    length = header(scope, b"content-length") or ""
    if length.isdigit() and int(length) > limit:
        raise ErrorKind.BODY_TOO_LARGE.error(limit=limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ErrorKind.CLIENT_GONE.error()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ErrorKind.BODY_TOO_LARGE.error(limit=limit)
        if not message.get("more_body", False):
            if not chunks:
                return chunk  # the common case: the whole body in one message
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)


async def _admit(
    deps: Deps, scope: Scope, receive: Receive, caller: Caller, kind: type[Body], path: str
) -> tuple[bytes, Body]:
    """The raw body and its parse, once it is valid and names a model the key may use."""
    table = deps.table
    try:
        raw = await read_body(scope, receive, deps.max_request_bytes)
        try:
            body = kind.model_validate_json(raw)
        except ValidationError as exc:
            raise invalid_body(exc) from None
        if not caller.policy.allows(body.model):
            raise ErrorKind.MODEL_NOT_ALLOWED.error(model=body.model)
        bounded(body, caller.policy)
        if body.model_extra and SALT_FIELD in body.model_extra:
            # The engine's cache partition is the router's to choose
            # (router/affinity/scope.py): a client's salt could name another's.
            raise invalid_fields(
                [f"{SALT_FIELD}: set by the gateway from the model's cache_scope, not by clients"],
                SALT_FIELD,
            )
        if not await table.knows(body.model):  # after one catalog re-read, rate-bounded
            raise ErrorKind.MODEL_NOT_FOUND.error(model=body.model)
        check_media(deps, body)
    except OpenAIError as exc:
        _refused(deps, path, exc)
        raise
    return raw, body


def _with_usage(raw: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """The body asking the engine for a stream's usage (the client did not),
    and that body as orjson reads it (what it wrote, parsed once for the
    prompt key too); None where orjson refuses it."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # What orjson refuses and the validation let through (NaN, integers
        # past 64 bits): the standard library's parser takes it.
        data = json.loads(raw)
        data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
        return json.dumps(data, separators=(",", ":")).encode(), None
    data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
    return orjson.dumps(data), data


async def _adapter_routes(
    deps: Deps, target: tuple[ModelSpec, AdapterSpec] | None, call: Call
) -> tuple[list[Route] | None, Callable[[], None] | None]:
    """Where a request for an adapter may go (and its release, loaded on demand);
    (None, None) for a model: the proxy balances among its replicas."""
    if target is None:
        return None, None
    base, adapter = target
    if base.profile.runtime_lora:
        route, release = await deps.adapters.on_demand_route(base, adapter)
        return [route], release
    routes, call.body_for = deps.adapters.static_routes(base, adapter.name, call.body)
    return routes, None


def _prompt_key(
    spec: ModelSpec | None,
    scope: Scope,
    raw: bytes,
    body: Body,
    key_id: int,
    routes: int,
    parsed: dict[str, Any] | None = None,
    cache_scope: str = "",
) -> PromptKey | None:
    """The prompt's chunk chain and sticky key for cache-aware routing; None
    where it has no use (embeddings, a least-loaded model, a model with
    ``routes`` <= 1 replicas and no pinned slots) or the body is not a JSON
    object orjson reads. ``parsed``: ``raw`` as orjson read it, when the
    caller already did (None: read here). ``cache_scope`` seeds its chunk
    chain (router/affinity/scope.py)."""
    if isinstance(body, EmbeddingRequest):
        return None
    # A model outside the catalog (deployed by hand) routes by the defaults.
    routing = spec.routing if spec is not None else DEFAULT_ROUTING
    # The key orders replicas and pins llama.cpp slots. Without slots to pin,
    # least-loaded needs none, nor does a model with one replica (or none
    # yet: scaled to zero): there is nothing to choose, and its reads and
    # hashes were most of what cache-aware routing cost such a model.
    # Nothing is recorded meanwhile, so when a second replica comes, the
    # model's index starts empty: conversations go by the rendezvous hash of
    # their lead, as on a freshly started router or for turns another router
    # served; about half move to the new replica and pay one full prefill
    # there, once (load that scaling up wanted moved anyway), and the index
    # learns from their next answers.
    if not routing.slots and (routing.policy is RoutingPolicyKind.LEAST_LOADED or routes <= 1):
        return None
    data = parsed
    if data is None:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(data, dict):
        return None
    # Namespaced by the key: one tenant's session or user names never meet
    # another's in the router's memory.
    # OpenAI's own prompt_cache_key first (the client named what shares a
    # prefix), then our session header, then the end user.
    sticky = None
    cache_key = data.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        sticky = f"cache:{key_id}:{cache_key[:MAX_SESSION_CHARS]}"
    elif session := header(scope, _SESSION_NAME):
        sticky = f"session:{key_id}:{session[:MAX_SESSION_CHARS]}"
    elif isinstance(user := data.get("user"), str) and user:
        sticky = f"user:{key_id}:{user[:MAX_SESSION_CHARS]}"
    return prompt_key(data, routing.chunk_tokens, sticky, cache_scope)


async def _serve(
    deps: Deps, scope: Scope, receive: Receive, caller: Caller, kind: type[Body], path: str
) -> ASGIApp:
    started = time.monotonic()
    raw, body = await _admit(deps, scope, receive, caller, kind, path)
    model = body.model
    prompt_estimate = estimate(body)
    stream, strip_usage = False, False
    parsed: dict[str, Any] | None = None  # the final raw as orjson read it, where it was
    target = deps.adapters.base_of(model)
    spec = target[0] if target else deps.table.specs.get(model)
    if target is None and spec is not None and spec.adapters:
        raw = base_body(spec, raw)
    reserve = reserved_tokens(body, spec.context_length if spec else DEFAULT_COMPLETION_RESERVE)
    if isinstance(body, _Generation):
        stream = body.stream
        if stream and not body.wants_usage():
            # Ask the engine for usage anyway, to bill the stream; hidden from the client.
            strip_usage = True
            raw, parsed = _with_usage(raw)

    endpoint = path.removeprefix("/v1/")
    span = _start_span(deps, scope, path, model, caller.key_id, stream)
    try:
        reservation = await deps.accountant.reserve(caller.key_id, caller.policy, reserve)
    except OpenAIError as exc:  # the store did not answer in time
        deps.metrics.requests.labels(endpoint, model, str(exc.status)).inc()
        end_span(span, RequestOutcome(error=True, status=exc.status))
        raise
    if isinstance(reservation, QuotaRejection):
        raise _over_quota(deps, endpoint, model, span, reservation)

    bill = RequestBill(
        deps.accountant, deps.metrics, caller.key_id, model, endpoint, reservation, span,
        started, prompt_estimate, reserve, bill_usage=not caller.billed_by_caller,
    )  # fmt: skip
    key = None
    cache_scope = scope_of(spec, caller.key_id)
    if target is None:  # a model's request only: an adapter's go where it is held
        # Its replicas as the table holds them now (in memory, never waited for).
        routes = len(deps.table.routes.get(model, ()))
        chain = deps.proxy.chain_scope(cache_scope)
        key = _prompt_key(spec, scope, raw, body, caller.key_id, routes, parsed, chain)
    call = Call(
        model=model,
        path=path,
        body=raw,
        stream=stream,
        strip_usage=strip_usage,
        bill=bill,
        started=started,
        finishes_when_gone=_generates_on(spec, stream),
        client_gone=lambda: disconnected(receive),
        traced=deps.tracer is not None,
        prompt_key=key,
        spec=spec,
        cache_scope=cache_scope,
    )
    try:
        # An on-demand adapter's load is part of the request (and its span);
        # with tracing off there is no span to make current. A model's
        # request may wait for a replica first (router/admission/queue.py).
        with trace.use_span(span, end_on_exit=False) if call.traced else _NO_SPAN:
            return await deps.admission.forward(
                call, caller.key_id, caller.policy, queue_cost(body, prompt_estimate),
                lambda: _forward(deps, target, call, bill), queueable=target is None,
                priority=caller.priority_override,
            )  # fmt: skip
    except OpenAIError as exc:
        bill.failed(exc.status)  # releases the reservation
        raise


def _generates_on(spec: ModelSpec | None, stream: bool) -> bool:
    """Whether the engine finishes a request whose client left: llama.cpp does
    a non-streamed one (vLLM aborts on the closed connection, and a stream
    stops at its next write)."""
    return not stream and spec is not None and spec.engine is EngineKind.LLAMA_CPP


async def _forward(
    deps: Deps,
    target: tuple[ModelSpec, AdapterSpec] | None,
    call: Call,
    bill: RequestBill,
) -> Reply | StreamReply:
    """Forward to the model's replicas or the adapter's holder; the ``bill``
    releases the adapter's use when the request is over."""
    routes, release = await _adapter_routes(deps, target, call)
    bill.release = release
    call.stale_on_404 = release is not None
    try:
        return await deps.proxy.forward(call, routes)
    except StaleAdapter as stale:
        # Another router unloaded it and our view lagged: load it (as for a
        # cold adapter) and send the request once more.
        assert target is not None and release is not None
        release()
        bill.release = None
        deps.adapters.forget(stale.route, target[1].name)
        call.stale_on_404 = False
        routes, release = await _adapter_routes(deps, target, call)
        bill.release = release
        return await deps.proxy.forward(call, routes)


def _over_quota(
    deps: Deps, endpoint: str, model: str, span: Span, rejection: QuotaRejection
) -> OpenAIError:
    """Count and trace a request refused by its key's quota; the error to raise."""
    # One that no window can ever admit is the request's fault: a 429 would
    # have clients retry it forever.
    error = (
        QUOTA_EXCEEDED[rejection.limit].error(
            message=rejection.message, retry_after_s=rejection.retry_after_s
        )
        if not rejection.never
        else ErrorKind.REQUEST_EXCEEDS_QUOTA.error(message=rejection.message)
    )
    deps.metrics.quota_rejections.labels(rejection.limit).inc()
    deps.metrics.requests.labels(endpoint, model, str(error.status)).inc()
    end_span(span, RequestOutcome(error=True, status=error.status))
    return error


def _start_span(deps: Deps, scope: Scope, path: str, model: str, key_id: int, stream: bool) -> Span:
    """One span per request, continuing the client's trace if it sent one; ended
    when the request is over (a stream: when its relay ends)."""
    if deps.tracer is None:
        return trace.INVALID_SPAN
    return deps.tracer.start_span(
        f"POST {path}",
        context=extract(Headers(scope=scope)),
        kind=SpanKind.SERVER,
        attributes={"llmgw.model": model, "llmgw.key_id": key_id, "llmgw.stream": stream},
    )


def error_reply(exc: OpenAIError) -> Reply:
    """An OpenAIError as the client gets it (as Starlette's JSONResponse rendered it)."""
    body = orjson.dumps(exc.body())
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    headers += [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]
    return Reply(exc.status, headers, body)


class InferenceEndpoint:
    """One inference route as a plain ASGI app: no Starlette Request or Response,
    no middleware (``router.app.RouterApp`` calls it directly for its path)."""

    def __init__(self, kind: type[Body], path: str) -> None:
        self.kind = kind
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deps: Deps = scope["app"].state.deps
        try:
            try:
                caller = await deps.keys.verify(
                    header(scope, b"authorization"), lambda name: header(scope, name.encode())
                )
            except OpenAIError as exc:
                _refused(deps, self.path, exc)
                raise
            reply = await _serve(deps, scope, receive, caller, self.kind, self.path)
        except OpenAIError as exc:
            reply = error_reply(exc)
        except Exception:
            # A bug: the client gets the OpenAI shape, no details; the server
            # logs it (re-raised, as Starlette's error middleware did).
            await error_reply(ErrorKind.INTERNAL_ERROR.error())(scope, receive, send)
            raise
        await reply(scope, receive, send)


# The hot path: plain ASGI endpoints, not FastAPI's routes. A FastAPI route
# solves its dependencies and parses query parameters on every request, and
# Starlette's Request/Response objects and middleware cost as much again
# (py-spy under tests/bench/bench_router); these handlers read the raw body
# anyway. Their OpenAPI entries are written out in ``inference_openapi``.
INFERENCE: list[tuple[str, type[Body], str, str]] = [
    ("/v1/chat/completions", ChatCompletionRequest, "Chat Completions",
     "Chat completions, streamed (SSE) or not."),
    ("/v1/completions", CompletionRequest, "Completions",
     "Text completions, streamed (SSE) or not."),
    ("/v1/embeddings", EmbeddingRequest, "Embeddings",
     "Embeddings (the model's engine must serve them: llama.cpp needs `--embeddings`)."),
]  # fmt: skip


def inference_routes() -> list[HttpRoute]:
    """The inference endpoints, the only paths that reach an engine."""
    return [
        HttpRoute(path, InferenceEndpoint(kind, path), methods=["POST"], include_in_schema=False)
        for path, kind, _, _ in INFERENCE
    ]


@router.get("/models")
async def list_models(deps: DepsDep, caller: CallerDep) -> dict[str, Any]:
    """Models with at least one ready replica, and those scaled to zero that a
    request wakes (those the key may use); ``llmgw_state`` says which."""
    now = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "llmgw", "llmgw_state": state}
            for m, state in deps.admission.model_states()
            if caller.policy.allows(m)
        ],
    }
