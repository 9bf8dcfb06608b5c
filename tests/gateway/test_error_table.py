"""router/common/errors.py's table: one row per kind of error, one builder. The
answers themselves are pinned where the router gives them (test_gateway,
test_admission, test_error_ids...); here, what the builder guarantees."""

import json
import re
from collections.abc import Callable
from string import Formatter
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from router.common.errors import (
    ERROR_ID_HEADER,
    QUOTA_EXCEEDED,
    ErrorBody,
    ErrorKind,
    Incidents,
    OpenAIError,
    engine_failed,
    engine_refused,
    invalid_body,
    invalid_fields,
    queue_timeout,
)


def _sample_fields(kind: ErrorKind) -> dict[str, Any]:
    names = {n for _, n, _, _ in Formatter().parse(kind.value.message) if n} - {"status"}
    return {n: 1.5 if n == "max_wait_s" else f"<{n}>" for n in names}


@pytest.mark.parametrize("kind", list(ErrorKind), ids=lambda k: k.name)
def test_every_kind_builds_an_openai_shaped_error(kind: ErrorKind) -> None:
    spec = kind.value
    fields = _sample_fields(kind)
    incidents = Incidents()
    error = kind.error(
        status=503 if spec.status is None else None,
        incidents=incidents if spec.hidden else None,
        reason="node n7 at /var/secret" if spec.hidden else "",
        **fields,
    )
    body = ErrorBody.model_validate(error.body())
    assert error.status == (spec.status or 503)
    assert (body.error.type, body.error.code) == (spec.type, spec.code)
    for value in fields.values():
        assert (f"{value:g}" if isinstance(value, float) else str(value)) in body.error.message
    if spec.retry_after_s is not None:
        assert error.headers["Retry-After"] == str(spec.retry_after_s)
    if spec.hidden:
        (incident,) = incidents.recent()
        assert error.headers[ERROR_ID_HEADER] == incident.error_id
        assert incident.error_id in body.error.message
        assert "secret" not in json.dumps(error.body())


def test_the_builder_refuses_fields_its_template_does_not_name() -> None:
    with pytest.raises(TypeError):
        ErrorKind.MODEL_NOT_FOUND.error()
    with pytest.raises(TypeError):
        ErrorKind.MODEL_NOT_FOUND.error(model="m", modle="m")
    with pytest.raises(TypeError):
        ErrorKind.INVALID_KEY.error(status=402)  # its status is fixed
    with pytest.raises(TypeError):
        ErrorKind.HTTP_ERROR.error(detail="x")  # and this one's is not
    with pytest.raises(TypeError):
        ErrorKind.WAKE_FAILED.error(model="m")  # a hidden reason needs its record


def test_one_row_per_kind_and_every_quota_limit_has_its_429() -> None:
    assert len(ErrorKind.__members__) == len(list(ErrorKind))  # no aliases
    assert set(QUOTA_EXCEEDED) == {"rpm", "tpm", "token_budget"}
    assert all(k.value.status == 429 for k in QUOTA_EXCEEDED.values())


def test_the_computed_headers() -> None:
    assert queue_timeout("m", 30).headers == {"Retry-After": "8"}
    assert queue_timeout("m", 0.5).headers == {"Retry-After": "1"}
    incidents = Incidents()
    assert engine_failed("m", 503, "x", incidents).headers["Retry-After"] == "1"
    assert "Retry-After" not in engine_failed("m", 500, "x", incidents).headers
    assert ErrorKind.ADAPTERS_UNAVAILABLE.error(adapter="a").headers == {}


# Every error as the factories of router/common/errors.py made it before the table
# (same arguments, bodies and headers; error ids as err_X): the table changed
# how they are written, not what a client gets.
INC = Incidents()


class _Shape(BaseModel):
    a: int


def _invalid(raw: str) -> ValidationError:
    try:
        _Shape.model_validate_json(raw)
    except ValidationError as exc:
        return exc
    raise AssertionError(raw)


BEFORE: dict[str, tuple[Callable[[], OpenAIError], tuple[object, ...], dict[str, str]]] = {
    "adapter_load_failed": (
        lambda: ErrorKind.ADAPTER_LOAD_FAILED.error(adapter="ad", replica_id="r1", kind="timeout"),
        (
            502,
            "Loading the adapter `ad` on replica r1 failed (timeout); the router's log says why.",
            "server_error",
            "adapter_load_failed",
            "model",
        ),
        {},
    ),
    "adapters_unavailable": (
        lambda: ErrorKind.ADAPTERS_UNAVAILABLE.error(adapter="ad"),
        (
            503,
            "The adapter `ad` is loaded on demand and this router cannot load adapters.",
            "service_unavailable_error",
            "adapter_loading_unavailable",
            None,
        ),
        {},
    ),
    "admin_required": (
        ErrorKind.ADMIN_REQUIRED.error,
        (
            401,
            "The admin API needs the admin key.",
            "invalid_request_error",
            "invalid_admin_key",
            None,
        ),
        {},
    ),
    "body_too_large": (
        lambda: ErrorKind.BODY_TOO_LARGE.error(limit=1024),
        (
            413,
            "The request body is larger than 1024 bytes.",
            "invalid_request_error",
            "body_too_large",
            None,
        ),
        {},
    ),
    "client_gone": (
        ErrorKind.CLIENT_GONE.error,
        (
            499,
            "The client closed the request.",
            "invalid_request_error",
            "client_closed_request",
            None,
        ),
        {},
    ),
    "engine_failed_500": (
        lambda: engine_failed("m", 500, "oops", INC),
        (
            500,
            "The engine of the model `m` could not serve the request (HTTP 500). (error id err_X)",
            "server_error",
            "engine_error",
            None,
        ),
        {"x-request-id": "err_X"},
    ),
    "engine_failed_503": (
        lambda: engine_failed("m", 503, "oops", INC),
        (
            503,
            "The engine of the model `m` could not serve the request (HTTP 503). (error id err_X)",
            "server_error",
            "engine_error",
            None,
        ),
        {"Retry-After": "1", "x-request-id": "err_X"},
    ),
    "engine_refused": (
        lambda: engine_refused(418, "teapot" * 100),
        (
            418,
            "teapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapotteapott"
            "e",
            "server_error",
            None,
            None,
        ),
        {},
    ),
    "engine_refused_empty": (
        lambda: engine_refused(500, ""),
        (500, "HTTP 500", "server_error", None, None),
        {},
    ),
    "http_error": (
        lambda: ErrorKind.HTTP_ERROR.error(status=405, detail="Method Not Allowed"),
        (405, "Method Not Allowed", "invalid_request_error", None, None),
        {},
    ),
    "internal_error": (
        ErrorKind.INTERNAL_ERROR.error,
        (500, "Internal error in the router.", "server_error", None, None),
        {},
    ),
    "invalid_body_field": (
        lambda: invalid_body(_invalid('{"a": "x"}')),
        (
            400,
            "a: Input should be a valid integer, unable to parse string as an integer",
            "invalid_request_error",
            None,
            "a",
        ),
        {},
    ),
    "invalid_body_json": (
        lambda: invalid_body(_invalid("{")),
        (400, "The request body is not valid JSON.", "invalid_request_error", None, None),
        {},
    ),
    "invalid_body_type": (
        lambda: invalid_body(_invalid("[1]")),
        (400, "The request body must be a JSON object.", "invalid_request_error", None, None),
        {},
    ),
    "invalid_fields": (
        lambda: invalid_fields(["a: x", "b: y"], "a"),
        (400, "a: x; b: y", "invalid_request_error", None, "a"),
        {},
    ),
    "invalid_fields_none": (
        lambda: invalid_fields(["a"], None),
        (400, "a", "invalid_request_error", None, None),
        {},
    ),
    "invalid_key": (
        ErrorKind.INVALID_KEY.error,
        (401, "Invalid API key.", "invalid_request_error", "invalid_api_key", None),
        {},
    ),
    "key_expired": (
        ErrorKind.KEY_EXPIRED.error,
        (401, "The API key has expired.", "invalid_request_error", "expired_api_key", None),
        {},
    ),
    "key_queue_full": (
        lambda: ErrorKind.KEY_QUEUE_FULL.error(model="m", share=3),
        (
            503,
            "Every replica of `m` is busy and 3 requests of this API key wait already (its"
            " share of the queue: queue.key_share); retry shortly.",
            "service_unavailable_error",
            "queue_full",
            None,
        ),
        {"Retry-After": "1"},
    ),
    "model_not_allowed": (
        lambda: ErrorKind.MODEL_NOT_ALLOWED.error(model="m"),
        (
            403,
            "This API key may not use the model `m`.",
            "permission_error",
            "model_not_allowed",
            "model",
        ),
        {},
    ),
    "model_not_found": (
        lambda: ErrorKind.MODEL_NOT_FOUND.error(model="m`x"),
        (
            404,
            "The model `m`x` does not exist.",
            "invalid_request_error",
            "model_not_found",
            "model",
        ),
        {},
    ),
    "name_mismatch": (
        lambda: ErrorKind.NAME_MISMATCH.error(body_name="a", path_name="b"),
        (400, "name: `a` differs from the path's `b`", "invalid_request_error", None, "name"),
        {},
    ),
    "no_ready_replica": (
        lambda: ErrorKind.NO_READY_REPLICA.error(model="m"),
        (
            503,
            "No ready replica of `m` can take the request; retry shortly.",
            "service_unavailable_error",
            "no_ready_replica",
            None,
        ),
        {"Retry-After": "1"},
    ),
    "no_temporal_client": (
        ErrorKind.NO_TEMPORAL_CLIENT.error,
        (503, "This router has no Temporal client.", "server_error", None, None),
        {},
    ),
    "not_found": (
        lambda: ErrorKind.NOT_FOUND.error(what="model", name="x"),
        (404, "No model `x`.", "invalid_request_error", "not_found", None),
        {},
    ),
    "queue_full": (
        lambda: ErrorKind.QUEUE_FULL.error(model="m", max_waiting=7),
        (
            503,
            "Every replica of `m` is busy and 7 requests wait already (queue.max_waiting);"
            " retry shortly.",
            "service_unavailable_error",
            "queue_full",
            None,
        ),
        {"Retry-After": "1"},
    ),
    "queue_timeout": (
        lambda: queue_timeout("m", 30.0),
        (
            503,
            "No replica of `m` took the request within 30 s (queue.max_wait_s); retry later.",
            "service_unavailable_error",
            "queue_timeout",
            None,
        ),
        {"Retry-After": "8"},
    ),
    "queue_timeout_frac": (
        lambda: queue_timeout("m", 12.5),
        (
            503,
            "No replica of `m` took the request within 12.5 s (queue.max_wait_s); retry later.",
            "service_unavailable_error",
            "queue_timeout",
            None,
        ),
        {"Retry-After": "3"},
    ),
    "queue_timeout_small": (
        lambda: queue_timeout("m", 0.25),
        (
            503,
            "No replica of `m` took the request within 0.25 s (queue.max_wait_s); retry later.",
            "service_unavailable_error",
            "queue_timeout",
            None,
        ),
        {"Retry-After": "1"},
    ),
    "quota_budget": (
        lambda: QUOTA_EXCEEDED["token_budget"].error(message="budget msg", retry_after_s=60),
        (429, "budget msg", "insufficient_quota", "insufficient_quota", None),
        {"Retry-After": "60"},
    ),
    "quota_rpm": (
        lambda: QUOTA_EXCEEDED["rpm"].error(message="rpm msg", retry_after_s=2),
        (429, "rpm msg", "requests", "rate_limit_exceeded", None),
        {"Retry-After": "2"},
    ),
    "quota_tpm": (
        lambda: QUOTA_EXCEEDED["tpm"].error(message="tpm msg", retry_after_s=3),
        (429, "tpm msg", "tokens", "rate_limit_exceeded", None),
        {"Retry-After": "3"},
    ),
    "remote_media_refused": (
        lambda: ErrorKind.REMOTE_MEDIA_REFUSED.error(
            model="m",
            where="messages[0].content[1].image_url.url",
            param="messages[0].content[1].image_url.url",
        ),
        (
            400,
            "Media URLs other than data: are not accepted for the model `m`"
            " (messages[0].content[1].image_url.url); send the media inline as a data: URL.",
            "invalid_request_error",
            "remote_media_refused",
            "messages[0].content[1].image_url.url",
        ),
        {},
    ),
    "replicas_saturated": (
        lambda: ErrorKind.REPLICAS_SATURATED.error(model="m"),
        (
            503,
            "Every replica of `m` is at its in-flight limit; retry shortly.",
            "service_unavailable_error",
            "replicas_saturated",
            None,
        ),
        {"Retry-After": "1"},
    ),
    "request_exceeds_quota": (
        lambda: ErrorKind.REQUEST_EXCEEDS_QUOTA.error(message="too big"),
        (400, "too big", "invalid_request_error", "request_exceeds_quota", None),
        {},
    ),
    "store_unavailable": (
        ErrorKind.STORE_UNAVAILABLE.error,
        (
            503,
            "The router's store did not answer in time; retry shortly.",
            "service_unavailable_error",
            "store_unavailable",
            None,
        ),
        {"Retry-After": "5"},
    ),
    "temporal_unavailable": (
        lambda: ErrorKind.TEMPORAL_UNAVAILABLE.error(exc=RuntimeError("boom")),
        (503, "Temporal did not answer: boom", "service_unavailable_error", "temporal", None),
        {},
    ),
    "unbounded_generation": (
        ErrorKind.UNBOUNDED_GENERATION.error,
        (
            400,
            "n_predict -1 (generate until the context is full) is not allowed for a key with"
            " a token quota; set max_tokens or a non-negative n_predict.",
            "invalid_request_error",
            None,
            "n_predict",
        ),
        {},
    ),
    "upstream_failed": (
        lambda: ErrorKind.UPSTREAM_FAILED.error(model="m", reason="r1 at 10.0.0.1", incidents=INC),
        (
            502,
            "The engine of the model `m` failed the request. (error id err_X)",
            "server_error",
            "upstream_error",
            None,
        ),
        {"x-request-id": "err_X"},
    ),
    "wake_failed": (
        lambda: ErrorKind.WAKE_FAILED.error(model="m", reason="secret reason", incidents=INC),
        (
            503,
            "The model `m` is scaled to zero and could not be woken; retry later. (error id err_X)",
            "service_unavailable_error",
            "wake_failed",
            None,
        ),
        {"x-request-id": "err_X"},
    ),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_answer_is_what_the_factories_gave(name: str) -> None:
    build, (status, message, type_, code, param), headers = BEFORE[name]
    error = build()
    got = re.sub(r"err_[0-9a-f]{16}", "err_X", json.dumps(error.body()))
    assert error.status == status
    assert json.loads(got) == {
        "error": {"message": message, "type": type_, "param": param, "code": code}
    }
    assert {k: re.sub(r"err_[0-9a-f]{16}", "err_X", v) for k, v in error.headers.items()} == headers
