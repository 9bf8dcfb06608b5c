"""OpenAI-shaped errors: every failure the router returns goes through here.

A failure inside the system (a wake that failed, an engine that broke off
or answered 5xx) reaches the API client as a fixed message, its ``code`` and
an error id (in the message and the ``x-request-id`` header, which the
openai client shows as ``request_id``): never a node name, a path, an
exception's text or an engine's log, which may carry secrets. The full
reason goes to the router's log, on one line with the id, and to
:class:`Incidents` (router/common/incidents.py), which the admin API serves
by id (``/admin/errors``).

Every error is a row of :class:`ErrorKind` (status, type, code, message
template, Retry-After, whether its reason is hidden) built by one method:
``raise ErrorKind.MODEL_NOT_FOUND.error(model=name)``. A status, param or
Retry-After that depends on the case (an engine's status, the field at
fault) is the builder's argument; the few helpers below compute one.
The app's exception handlers that answer with these are in
router/common/error_handlers.py.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, unique
from functools import cache
from string import Formatter

from pydantic import BaseModel, Field, ValidationError

from llmgw.errors import LlmgwError

# Named here too (an explicit re-export): importers take every error name from here.
from router.common.incidents import Incidents as Incidents  # noqa: PLC0414

# The header carrying an error's id (the openai client reads it as request_id).
ERROR_ID_HEADER = "x-request-id"


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


class ErrorDetail(BaseModel):
    """What went wrong, as OpenAI's clients parse it."""

    message: str
    type: str
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str | None = Field(description="Machine-readable: `model_not_found`, `queue_full`...")


class ErrorBody(BaseModel):
    """The body of every error answer (the OpenAPI description's error schema)."""

    error: ErrorDetail


@dataclass(frozen=True)
class ErrorSpec:
    """One row of the error table: what the client gets for one kind of failure."""

    status: int | None  # None: the builder's status (an engine's, the framework's)
    message: str  # a str.format template over the builder's fields
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None  # the field at fault, when it is always the same one
    retry_after_s: int | None = None  # sent as Retry-After: "retry shortly"
    # The client gets ``message`` and an error id; the builder's ``reason``
    # (node names, paths, an engine's log: maybe secrets) goes to Incidents.
    hidden: bool = False


_UNAVAILABLE = "service_unavailable_error"


@unique
class ErrorKind(Enum):
    """Every error the router makes, one row each; :meth:`error` builds one."""

    # Keys and permissions.
    INVALID_KEY = ErrorSpec(401, "Invalid API key.", code="invalid_api_key")
    KEY_EXPIRED = ErrorSpec(401, "The API key has expired.", code="expired_api_key")
    ADMIN_REQUIRED = ErrorSpec(401, "The admin API needs the admin key.", code="invalid_admin_key")
    MODEL_NOT_ALLOWED = ErrorSpec(
        403,
        "This API key may not use the model `{model}`.",
        type="permission_error",
        code="model_not_allowed",
        param="model",
    )
    MODEL_NOT_FOUND = ErrorSpec(
        404, "The model `{model}` does not exist.", code="model_not_found", param="model"
    )
    # Quotas (router/billing/quotas.py writes the message).
    TOKEN_BUDGET_EXCEEDED = ErrorSpec(
        429, "{message}", type="insufficient_quota", code="insufficient_quota"
    )
    REQUEST_RATE_EXCEEDED = ErrorSpec(429, "{message}", type="requests", code="rate_limit_exceeded")
    TOKEN_RATE_EXCEEDED = ErrorSpec(429, "{message}", type="tokens", code="rate_limit_exceeded")
    # 400, not 429: no window of the key's quota can ever admit this request,
    # and a 429 would have clients retry it forever.
    REQUEST_EXCEEDS_QUOTA = ErrorSpec(400, "{message}", code="request_exceeds_quota")
    # The request itself.
    INVALID_FIELDS = ErrorSpec(400, "{problems}")  # every problem; the first field in param
    INVALID_JSON = ErrorSpec(400, "The request body is not valid JSON.")
    NOT_AN_OBJECT = ErrorSpec(400, "The request body must be a JSON object.")
    # A key whose tokens are counted may not generate until the context is full.
    UNBOUNDED_GENERATION = ErrorSpec(
        400,
        "n_predict -1 (generate until the context is full) is not allowed for a key"
        " with a token quota; set max_tokens or a non-negative n_predict.",
        param="n_predict",
    )
    # A media URL the engine would fetch itself, for a model whose catalog
    # entry does not allow them (router/api/media.py); param says where.
    REMOTE_MEDIA_REFUSED = ErrorSpec(
        400,
        "Media URLs other than data: are not accepted for the model `{model}` ({where});"
        " send the media inline as a data: URL.",
        code="remote_media_refused",
    )
    BODY_TOO_LARGE = ErrorSpec(
        413, "The request body is larger than {limit} bytes.", code="body_too_large"
    )
    # nginx's 499: nobody reads it, but logs and metrics tell it from a 5xx.
    CLIENT_GONE = ErrorSpec(499, "The client closed the request.", code="client_closed_request")
    # "Retry shortly": 503 with a Retry-After.
    NO_READY_REPLICA = ErrorSpec(
        503,
        "No ready replica of `{model}` can take the request; retry shortly.",
        type=_UNAVAILABLE,
        code="no_ready_replica",
        retry_after_s=1,
    )
    REPLICAS_SATURATED = ErrorSpec(
        503,
        "Every replica of `{model}` is at its in-flight limit; retry shortly.",
        type=_UNAVAILABLE,
        code="replicas_saturated",
        retry_after_s=1,
    )
    # The model's admission queue holds queue.max_waiting requests already.
    QUEUE_FULL = ErrorSpec(
        503,
        "Every replica of `{model}` is busy and {max_waiting} requests wait already"
        " (queue.max_waiting); retry shortly.",
        type=_UNAVAILABLE,
        code="queue_full",
        retry_after_s=1,
    )
    # This key has its share of the model's admission queue waiting already.
    KEY_QUEUE_FULL = ErrorSpec(
        503,
        "Every replica of `{model}` is busy and {share} requests of this API key wait"
        " already (its share of the queue: queue.key_share); retry shortly.",
        type=_UNAVAILABLE,
        code="queue_full",
        retry_after_s=1,
    )
    # Waited queue.max_wait_s without a replica taking it (Retry-After: see queue_timeout).
    QUEUE_TIMEOUT = ErrorSpec(
        503,
        "No replica of `{model}` took the request within {max_wait_s:g} s"
        " (queue.max_wait_s); retry later.",
        type=_UNAVAILABLE,
        code="queue_timeout",
    )
    # The store did not answer within LLMGW_STORE_WAIT_S, for a key with no
    # recent answer, a quota reservation or an admin call.
    STORE_UNAVAILABLE = ErrorSpec(
        503,
        "The router's store did not answer in time; retry shortly.",
        type=_UNAVAILABLE,
        code="store_unavailable",
        retry_after_s=5,
    )
    # The model is scaled to zero and its wake failed.
    WAKE_FAILED = ErrorSpec(
        503,
        "The model `{model}` is scaled to zero and could not be woken; retry later.",
        type=_UNAVAILABLE,
        code="wake_failed",
        hidden=True,
    )
    # Engines and adapters.
    UPSTREAM_FAILED = ErrorSpec(  # no engine answered (replica, address, exception: hidden)
        502,
        "The engine of the model `{model}` failed the request.",
        type="server_error",
        code="upstream_error",
        hidden=True,
    )
    ENGINE_FAILED = ErrorSpec(  # an engine's own 5xx, its status kept, its text hidden
        None,
        "The engine of the model `{model}` could not serve the request (HTTP {status}).",
        type="server_error",
        code="engine_error",
        hidden=True,
    )
    # An engine's error answer without the OpenAI shape, as its status and text.
    ENGINE_REFUSED = ErrorSpec(None, "{text}", type="server_error")
    # Why is in the router's log, which may name paths and addresses.
    ADAPTER_LOAD_FAILED = ErrorSpec(
        502,
        "Loading the adapter `{adapter}` on replica {replica_id} failed ({kind});"
        " the router's log says why.",
        type="server_error",
        code="adapter_load_failed",
        param="model",
    )
    # On-demand adapters need Temporal, and this router has none.
    ADAPTERS_UNAVAILABLE = ErrorSpec(
        503,
        "The adapter `{adapter}` is loaded on demand and this router cannot load adapters.",
        type=_UNAVAILABLE,
        code="adapter_loading_unavailable",
    )
    # The admin API.
    NOT_FOUND = ErrorSpec(404, "No {what} `{name}`.", code="not_found")
    KEY_REVOKED = ErrorSpec(
        409, "Key {key_id} is revoked: its policy cannot change.", code="key_revoked"
    )
    NAME_MISMATCH = ErrorSpec(  # a PUT whose body names another entry than its path
        400, "name: `{body_name}` differs from the path's `{path_name}`", param="name"
    )
    NO_TEMPORAL_CLIENT = ErrorSpec(503, "This router has no Temporal client.", type="server_error")
    TEMPORAL_UNAVAILABLE = ErrorSpec(
        503, "Temporal did not answer: {exc}", type=_UNAVAILABLE, code="temporal"
    )
    # Responses (/v1/responses): OpenAI's own messages, so clients that match them work.
    RESPONSE_NOT_FOUND = ErrorSpec(404, "Response with id '{response_id}' not found.")
    PREVIOUS_RESPONSE_NOT_FOUND = ErrorSpec(
        400,
        "Previous response with id '{response_id}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
    )
    PREVIOUS_RESPONSE_FAILED = ErrorSpec(
        400,
        "Previous response with id '{response_id}' failed: it cannot be continued.",
        code="previous_response_failed",
        param="previous_response_id",
    )
    RESPONSE_TOO_LARGE = ErrorSpec(
        400,
        "This response would store more than {limit} bytes with its conversation "
        "(LLMGW_MAX_RESPONSE_BYTES): start a new one without previous_response_id, "
        "or send less input. Nothing was stored.",
        code="response_too_large",
        param="input",
    )
    RESPONSE_STORAGE_FULL = ErrorSpec(
        400,
        "This key's stored responses would hold more than {limit} bytes ({used} in use, "
        "LLMGW_MAX_KEY_RESPONSE_BYTES): delete responses it no longer needs, or send "
        "store=false. Nothing was stored.",
        code="response_storage_full",
        param="store",
    )
    SYNCHRONOUS_RESPONSE = ErrorSpec(400, "Cannot cancel a synchronous response.")
    RESPONSE_NOT_STREAMABLE = ErrorSpec(
        400,
        "Response with id '{response_id}' was not created with background=true: "
        "only a background response's events are kept to stream again.",
        param="stream",
    )
    # Files (/v1/files): OpenAI's message for an unknown id (another key's too).
    FILE_NOT_FOUND = ErrorSpec(404, "No such File object: {file_id}", param="id")
    FILE_TOO_LARGE = ErrorSpec(
        413,
        "The file is larger than {limit} bytes (LLMGW_MAX_FILE_BYTES); nothing was stored.",
        code="file_too_large",
        param="file",
    )
    KEY_STORAGE_FULL = ErrorSpec(
        413,
        "This key's files would hold more than {limit} bytes ({used} in use, "
        "LLMGW_MAX_KEY_FILE_BYTES); delete files it no longer needs. Nothing was stored.",
        code="file_storage_full",
        param="file",
    )
    EXEC_ONLY = ErrorSpec(
        401, "This endpoint serves llmgw's executor only.", code="invalid_api_key"
    )
    # The exec token acts as its job's key on the inference endpoints only.
    EXEC_NOT_ALLOWED = ErrorSpec(
        403,
        "The exec token acts only on the inference endpoints, not here.",
        type="permission_error",
        code="exec_token_not_allowed",
    )
    # Batches (/v1/batches): OpenAI's own messages where it has them.
    BATCH_NOT_FOUND = ErrorSpec(404, "No batch found with id '{batch_id}'.")
    BATCH_FILE_NOT_FOUND = ErrorSpec(
        404, "No such File object: {file_id}", code="file_not_found", param="input_file_id"
    )
    BATCH_FILE_PURPOSE = ErrorSpec(
        400,
        "The file {file_id} has purpose '{purpose}'; a batch's input file needs purpose 'batch'.",
        code="invalid_file_purpose",
        param="input_file_id",
    )
    BATCH_NOT_CANCELLABLE = ErrorSpec(400, "Cannot cancel a batch with status '{batch_status}'.")
    # The framework's own (unknown path, wrong method), and a bug of ours
    # (the client gets no details; Starlette logs them).
    HTTP_ERROR = ErrorSpec(None, "{detail}")
    INTERNAL_ERROR = ErrorSpec(500, "Internal error in the router.", type="server_error")

    def error(
        self,
        *,
        status: int | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
        incidents: Incidents | None = None,
        reason: str = "",
        **fields: object,
    ) -> OpenAIError:
        """The error of this kind: its message formatted with ``fields`` (exactly
        the template's), ``status``, ``param`` and ``retry_after_s`` where the
        row leaves them open, and for a hidden kind ``reason`` recorded in
        ``incidents``."""
        spec: ErrorSpec = self.value
        if set(fields) != _fields_of(spec.message) - {"status"}:
            raise TypeError(f"{self.name} takes {sorted(_fields_of(spec.message))}")
        if (spec.status is None) == (status is None):
            raise TypeError(f"{self.name}: a status is {'fixed' if spec.status else 'needed'}")
        status = spec.status if spec.status is not None else status
        assert status is not None
        message = spec.message.format(status=status, **fields)
        retry = spec.retry_after_s if retry_after_s is None else retry_after_s
        headers = {} if retry is None else {"Retry-After": str(retry)}
        if spec.hidden:
            if incidents is None:
                raise TypeError(f"{self.name} takes incidents and a reason")
            error_id = incidents.record(status, spec.code or "", str(fields["model"]), reason)
            message = f"{message} (error id {error_id})"
            headers[ERROR_ID_HEADER] = error_id
        return OpenAIError(
            status, message, spec.type, spec.code, spec.param or param, headers or None
        )


@cache
def _fields_of(template: str) -> frozenset[str]:
    return frozenset(name for _, name, _, _ in Formatter().parse(template) if name)


# Which 429 a quota rejection is (router/billing/quotas.py's ``limit``).
QUOTA_EXCEEDED = {
    "token_budget": ErrorKind.TOKEN_BUDGET_EXCEEDED,
    "rpm": ErrorKind.REQUEST_RATE_EXCEEDED,
    "tpm": ErrorKind.TOKEN_RATE_EXCEEDED,
}


def queue_timeout(model: str, max_wait_s: float) -> OpenAIError:
    """503 after ``queue.max_wait_s``: retrying at once would only wait again."""
    return ErrorKind.QUEUE_TIMEOUT.error(
        model=model, max_wait_s=max_wait_s, retry_after_s=max(1, round(max_wait_s / 4))
    )


def engine_failed(model: str, status: int, answer: str, incidents: Incidents) -> OpenAIError:
    """An engine's own 5xx answer, its text (exception text, paths, maybe
    what its log said) for admins only; the client keeps the status."""
    return ErrorKind.ENGINE_FAILED.error(
        model=model,
        status=status,
        retry_after_s=1 if status == 503 else None,
        incidents=incidents,
        reason=f"engine answered {status}: {answer}",
    )


def engine_refused(status: int, text: str) -> OpenAIError:
    """An engine's error answer without the OpenAI shape, as its status and text."""
    return ErrorKind.ENGINE_REFUSED.error(status=status, text=text[:500] or f"HTTP {status}")


def sse_error(error: OpenAIError) -> bytes:
    """An error as an SSE event: a stream that already answered 200 ends with it
    (the openai client raises an APIError on an event carrying ``error``)."""
    return b"data: " + json.dumps(error.body(), separators=(",", ":")).encode() + b"\n\n"


def relayed_error(status: int, body: bytes) -> OpenAIError:
    """An error answer of the router's own endpoints, as the same error for a
    request served through one (a response's chat request: router/api/response_chat.py)."""
    try:
        error = json.loads(body)["error"]
        return OpenAIError(
            status,
            error["message"],
            error.get("type") or "invalid_request_error",
            error.get("code"),
            error.get("param"),
        )
    except (ValueError, KeyError, TypeError):
        return ErrorKind.INTERNAL_ERROR.error()


def invalid_fields(problems: Sequence[str], param: str | None) -> OpenAIError:
    """400: every problem with the request in the message, the first field in param."""
    return ErrorKind.INVALID_FIELDS.error(problems="; ".join(problems), param=param)


def invalid_body(exc: ValidationError) -> OpenAIError:
    """A 400 naming the first bad field (every problem in the message)."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        return ErrorKind.INVALID_JSON.error()
    if errors and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
        return ErrorKind.NOT_AN_OBJECT.error()
    problems = []
    for e in errors:
        loc = ".".join(str(p) for p in e["loc"])
        problems.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
    return invalid_fields(problems, first or None)
