"""router/errors.py's table: one row per kind of error, one builder. The
answers themselves are pinned where the router gives them (test_gateway,
test_admission, test_error_ids...); here, what the builder guarantees."""

import json
from string import Formatter
from typing import Any

import pytest

from router.errors import (
    ERROR_ID_HEADER,
    QUOTA_EXCEEDED,
    ErrorBody,
    ErrorKind,
    Incidents,
    engine_failed,
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
