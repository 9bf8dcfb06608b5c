"""OpenAI-shaped errors: every failure the router returns goes through here.

A failure inside the system (a wake that failed, an engine that broke off
or answered 5xx) reaches the API client as a fixed message, its ``code`` and
an error id (in the message and the ``x-request-id`` header, which the
openai client shows as ``request_id``): never a node name, a path, an
exception's text or an engine's log, which may carry secrets. The full
reason goes to the router's log, on one line with the id, and to
:class:`Incidents`, which the admin API serves by id (``/admin/errors``).
"""

import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw.errors import LlmgwError

log = logging.getLogger(__name__)

# The header carrying an error's id (the openai client reads it as request_id).
ERROR_ID_HEADER = "x-request-id"
# Reasons kept for the admin API; the log keeps every one.
KEEP_INCIDENTS = 1000
# A reason is cut past this (an engine's answer may be long).
MAX_REASON_CHARS = 4000


class Incident(BaseModel):
    """Why a client got a fixed message: the full reason, for admins only
    (``/admin/errors``; a model so the API reference documents its fields)."""

    model_config = ConfigDict(frozen=True)

    error_id: str = Field(description="The id the client was given (its x-request-id).")
    at: float = Field(description="When, in epoch seconds.")
    status: int = Field(description="The HTTP status the client got.")
    code: str = Field(description="The error code the client got.")
    model: str = Field(description="The model the request named.")
    reason: str = Field(description="The full reason (node names, paths, engine output).")


class Incidents:
    """The full reasons behind the errors clients got without them, by error id:
    logged as they happen (one line with the id), the last ``keep`` kept."""

    def __init__(self, keep: int = KEEP_INCIDENTS, clock: Callable[[], float] = time.time):
        self._keep = keep
        self._clock = clock
        self._by_id: OrderedDict[str, Incident] = OrderedDict()

    def record(self, status: int, code: str, model: str, reason: str) -> str:
        """Log and keep ``reason``; the id the client is given."""
        error_id = f"err_{secrets.token_hex(8)}"
        reason = reason[:MAX_REASON_CHARS]
        log.warning("%d %s for `%s` (error id %s): %s", status, code, model, error_id, reason)
        self._by_id[error_id] = Incident(
            error_id=error_id,
            at=self._clock(),
            status=status,
            code=code,
            model=model,
            reason=reason,
        )
        while len(self._by_id) > self._keep:
            self._by_id.popitem(last=False)
        return error_id

    def get(self, error_id: str) -> Incident | None:
        """The incident behind ``error_id``, while it is kept."""
        return self._by_id.get(error_id)

    def recent(self, limit: int = 100) -> list[Incident]:
        """The latest incidents, newest first."""
        return list(reversed(self._by_id.values()))[:limit]


class OpenAIError(LlmgwError):
    """An error the client sees as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        """The JSON body OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_key() -> OpenAIError:
    return OpenAIError(401, "Invalid API key.", code="invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
    )


def _unavailable(message: str, code: str, retry_after_s: int = 1) -> OpenAIError:
    """503 with a Retry-After: the shape of every "retry shortly" error below."""
    return OpenAIError(
        503,
        message,
        type="service_unavailable_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def no_ready_replica(model: str) -> OpenAIError:
    return _unavailable(
        f"No ready replica of `{model}` can take the request; retry shortly.", "no_ready_replica"
    )


def replicas_saturated(model: str) -> OpenAIError:
    return _unavailable(
        f"Every replica of `{model}` is at its in-flight limit; retry shortly.",
        "replicas_saturated",
    )


def queue_full(model: str, max_waiting: int) -> OpenAIError:
    """503: the model's admission queue holds ``max_waiting`` requests already."""
    return _unavailable(
        f"Every replica of `{model}` is busy and {max_waiting} requests wait already"
        " (queue.max_waiting); retry shortly.",
        "queue_full",
    )


def key_queue_full(model: str, share: int) -> OpenAIError:
    """503: this key has its share of the model's admission queue waiting already."""
    return _unavailable(
        f"Every replica of `{model}` is busy and {share} requests of this API key wait"
        " already (its share of the queue: queue.key_share); retry shortly.",
        "queue_full",
    )


def queue_timeout(model: str, max_wait_s: float) -> OpenAIError:
    """503: the request waited ``queue.max_wait_s`` without a replica taking it."""
    return _unavailable(
        f"No replica of `{model}` took the request within {max_wait_s:g} s"
        " (queue.max_wait_s); retry later.",
        "queue_timeout",
        retry_after_s=max(1, round(max_wait_s / 4)),
    )


def store_unavailable() -> OpenAIError:
    """503: the store did not answer within the router's bound (LLMGW_STORE_WAIT_S)
    for a key with no recent answer, or for a quota reservation."""
    return _unavailable(
        "The router's store did not answer in time; retry shortly.",
        "store_unavailable",
        retry_after_s=5,
    )


def _hidden(
    incidents: Incidents,
    status: int,
    code: str,
    model: str,
    message: str,
    reason: str,
    type: str,
    headers: dict[str, str] | None = None,
) -> OpenAIError:
    """An error whose ``reason`` only admins see: the client gets ``message``
    and the error id that finds the reason (log, admin API)."""
    error_id = incidents.record(status, code, model, reason)
    return OpenAIError(
        status,
        f"{message} (error id {error_id})",
        type=type,
        code=code,
        headers={**(headers or {}), ERROR_ID_HEADER: error_id},
    )


def wake_failed(model: str, reason: str, incidents: Incidents) -> OpenAIError:
    """503: the model is scaled to zero and its wake failed; ``reason`` (which
    may name nodes, paths and an engine's log) goes to admins only."""
    return _hidden(
        incidents,
        503,
        "wake_failed",
        model,
        f"The model `{model}` is scaled to zero and could not be woken; retry later.",
        reason,
        "service_unavailable_error",
    )


def engine_refused(status: int, text: str) -> OpenAIError:
    """An engine's error answer without the OpenAI shape, as its status and text."""
    return OpenAIError(status, text[:500] or f"HTTP {status}", type="server_error")


def sse_error(error: OpenAIError) -> bytes:
    """An error as an SSE event: a stream that already answered 200 ends with it
    (the openai client raises an APIError on an event carrying ``error``)."""
    return b"data: " + json.dumps(error.body(), separators=(",", ":")).encode() + b"\n\n"


def key_expired() -> OpenAIError:
    return OpenAIError(401, "The API key has expired.", code="expired_api_key")


def model_not_allowed(model: str) -> OpenAIError:
    return OpenAIError(
        403,
        f"This API key may not use the model `{model}`.",
        type="permission_error",
        code="model_not_allowed",
        param="model",
    )


def admin_required() -> OpenAIError:
    return OpenAIError(401, "The admin API needs the admin key.", code="invalid_admin_key")


def quota_exceeded(limit: str, message: str, retry_after_s: int) -> OpenAIError:
    budget = limit == "token_budget"
    return OpenAIError(
        429,
        message,
        type="insufficient_quota" if budget else ("requests" if limit == "rpm" else "tokens"),
        code="insufficient_quota" if budget else "rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"The request body is larger than {limit} bytes.", code="body_too_large"
    )


def client_gone() -> OpenAIError:
    # nginx's 499: nobody reads it, but logs and metrics tell it from a 5xx.
    return OpenAIError(499, "The client closed the request.", code="client_closed_request")


def upstream_failed(model: str, reason: str, incidents: Incidents) -> OpenAIError:
    """502: no engine of ``model`` answered the request; ``reason`` (replica,
    address, exception) goes to admins only."""
    return _hidden(
        incidents,
        502,
        "upstream_error",
        model,
        f"The engine of the model `{model}` failed the request.",
        reason,
        "server_error",
    )


def engine_failed(model: str, status: int, answer: str, incidents: Incidents) -> OpenAIError:
    """An engine's own 5xx answer, its text (exception text, paths, maybe
    what its log said) for admins only; the client keeps the status."""
    return _hidden(
        incidents,
        status,
        "engine_error",
        model,
        f"The engine of the model `{model}` could not serve the request (HTTP {status}).",
        f"engine answered {status}: {answer}",
        "server_error",
        {"Retry-After": "1"} if status == 503 else None,
    )


def remote_media_refused(model: str, where: str) -> OpenAIError:
    """400: a media URL the engine would fetch itself, for a model whose catalog
    entry does not allow them (router/api/media.py)."""
    return OpenAIError(
        400,
        f"Media URLs other than data: are not accepted for the model `{model}` ({where});"
        " send the media inline as a data: URL.",
        code="remote_media_refused",
        param=where,
    )


def invalid_fields(problems: Sequence[str], param: str | None) -> OpenAIError:
    """400: every problem with the request in the message, the first field in param."""
    return OpenAIError(400, "; ".join(problems), param=param)


def invalid_body(exc: ValidationError) -> OpenAIError:
    """A 400 naming the first bad field (every problem in the message)."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        return OpenAIError(400, "The request body is not valid JSON.")
    if errors and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
        return OpenAIError(400, "The request body must be a JSON object.")
    problems = []
    for e in errors:
        loc = ".".join(str(p) for p in e["loc"])
        problems.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
    return invalid_fields(problems, first or None)


def unbounded_generation() -> OpenAIError:
    """400: a key whose tokens are counted may not generate until the context is full."""
    return OpenAIError(
        400,
        "n_predict -1 (generate until the context is full) is not allowed for a key"
        " with a token quota; set max_tokens or a non-negative n_predict.",
        param="n_predict",
    )


def request_exceeds_quota(message: str) -> OpenAIError:
    """400, not 429: no window of the key's quota can ever admit this request,
    and a 429 would have clients retry it forever."""
    return OpenAIError(400, message, code="request_exceeds_quota")


def adapter_load_failed(adapter: str, replica_id: str, kind: str) -> OpenAIError:
    """502: the adapter could not be loaded (a later request tries again); why is
    in the router's log, which may name paths and addresses the client must not see."""
    return OpenAIError(
        502,
        f"Loading the adapter `{adapter}` on replica {replica_id} failed ({kind});"
        " the router's log says why.",
        type="server_error",
        code="adapter_load_failed",
        param="model",
    )


def adapters_unavailable(adapter: str) -> OpenAIError:
    """503: on-demand adapters need Temporal, and this router has none."""
    return OpenAIError(
        503,
        f"The adapter `{adapter}` is loaded on demand and this router cannot load adapters.",
        type="service_unavailable_error",
        code="adapter_loading_unavailable",
    )


def not_found(what: str, name: str) -> OpenAIError:
    """404 from the admin API: no such model, key or running replica."""
    return OpenAIError(404, f"No {what} `{name}`.", code="not_found")


def name_mismatch(body_name: str, path_name: str) -> OpenAIError:
    """400: an admin PUT whose body names another entry than its path."""
    return OpenAIError(
        400, f"name: `{body_name}` differs from the path's `{path_name}`", param="name"
    )


def no_temporal_client() -> OpenAIError:
    """503: the admin call needs Temporal and this router runs without it."""
    return OpenAIError(503, "This router has no Temporal client.", type="server_error")


def temporal_unavailable(exc: Exception) -> OpenAIError:
    """503: Temporal did not answer the admin call."""
    return OpenAIError(
        503, f"Temporal did not answer: {exc}", type="service_unavailable_error", code="temporal"
    )


def http_error(status: int, detail: str) -> OpenAIError:
    """The framework's own HTTP errors (unknown path, wrong method) in the OpenAI shape."""
    return OpenAIError(status, detail, code=None)


def internal_error() -> OpenAIError:
    """500: a bug in the router; the client gets no details (Starlette logs them)."""
    return OpenAIError(500, "Internal error in the router.", type="server_error")


def install_handlers(app: FastAPI) -> None:
    """Map every error, ours and the framework's, to the OpenAI shape."""

    async def on_openai(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        # Every problem in the message, each naming its field; the first in param.
        where = [
            ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "path", "query"))
            for e in exc.errors()
        ]
        problems = [
            f"{w or 'body'}: {e.get('msg', 'invalid')}"
            for w, e in zip(where, exc.errors(), strict=True)
        ]
        first = where[0] if where else ""
        err = invalid_fields(problems or ["invalid request"], first or None)
        return JSONResponse(err.body(), status_code=400)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = http_error(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def on_bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the exception; the client gets the OpenAI shape, no details.
        err = internal_error()
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(OpenAIError, on_openai)
    app.add_exception_handler(Exception, on_bug)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
