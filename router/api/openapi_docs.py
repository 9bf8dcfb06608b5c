"""The OpenAPI description: what the server answers, for the docs, for
schema-driven clients and for tests (tests/gateway/test_router_fuzz.py runs
schemathesis against it).

The inference endpoints are plain ASGI endpoints that read the raw body (it
is forwarded as is), so FastAPI cannot derive their documentation: it is
written out here. FastAPI documents the other routes, except what our
handlers change (router/common/errors.py): a validation error is a 400 in the
OpenAI shape, never FastAPI's 422, and every keyed path may answer 401 and a
store outage's 503. :func:`truthful` says so.
"""

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from router.common.errors import ErrorBody


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    # The handlers read the raw body (it is forwarded as is), so the schema
    # is declared here for the docs and for schema-driven clients and tests;
    # inlined, since pydantic's "#/$defs" references mean nothing in OpenAPI.
    schema = model.model_json_schema()
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _inline(schema, schema.get("$defs", {}))}},
        }
    }


# The error schema, a component (router/common/errors.py's ErrorBody).
ERROR_SCHEMA_NAME = ErrorBody.__name__
_ERROR_CONTENT = {
    "application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}}
}
# Headers some errors carry: documented, none required (not every 503 has one).
RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying",
        "schema": {"type": "integer", "minimum": 0},
    }
}
ERROR_ID = {
    "x-request-id": {
        "description": "The error id: an admin finds the full reason at /admin/errors/{id}",
        "schema": {"type": "string"},
    }
}

_ERRORS = {
    "400": "Bad request: malformed JSON or an invalid field (`param` names it), a request"
    " no window of the key's quota can admit (`request_exceeds_quota`), or a media"
    " URL other than data: for a model that does not allow them (`remote_media_refused`)",
    "401": "Missing, unknown, revoked or expired API key",
    "403": "The key may not use this model",
    "404": "No such model",
    "408": "The request body did not arrive within LLMGW_BODY_TIMEOUT_S (`body_timeout`)",
    "413": "Request body too large",
    "429": "Quota exceeded (`Retry-After` says when to retry)",
    "502": "The engine failed, or an on-demand adapter could not be loaded",
    "503": "No ready replica, all are saturated and the queue is full or waited too long"
    " (`Retry-After`), a model scaled to zero could not be woken, or the store did not"
    " answer in time (`store_unavailable`)",
}
_ERROR_HEADERS = {
    "429": RETRY_AFTER,
    "502": ERROR_ID,
    "503": {**RETRY_AFTER, **ERROR_ID},
}
# What every operation of a keyed prefix may answer besides its own.
_KEYED = {
    "/v1/": {
        "401": "Missing, unknown, revoked or expired API key",
        "503": "The store did not answer in time for a key it had no recent answer of"
        " (`store_unavailable`, `Retry-After`)",
    },
    "/admin/": {
        "401": "Missing or wrong admin key (`invalid_admin_key`)",
        "503": "The store did not answer in time (`store_unavailable`, `Retry-After`)",
    },
}
_INVALID = "Bad request: an invalid path, query or body field (`param` names it)"


def error_answer(description: str, status: str = "") -> dict[str, Any]:
    """An OpenAPI response carrying the error body (and the headers ``status`` may carry)."""
    answer: dict[str, Any] = {"description": description, "content": _ERROR_CONTENT}
    if headers := _ERROR_HEADERS.get(status):
        answer["headers"] = headers
    return answer


def error_responses(meanings: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """FastAPI's ``responses=`` for an operation's own error answers."""
    return {status: {"model": ErrorBody, "description": m} for status, m in meanings.items()}


def truthful(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's description of its routes corrected to what the server answers:
    400 for an invalid input (not 422), and what the credential check adds."""
    for path, item in schema["paths"].items():
        keyed = next((v for k, v in _KEYED.items() if path.startswith(k)), {})
        for op in item.values():
            responses = op["responses"]
            if responses.pop("422", None) is not None:
                responses.setdefault("400", error_answer(_INVALID))
            for status, meaning in keyed.items():
                responses.setdefault(status, error_answer(meaning))
            for status, answer in responses.items():
                if status in _ERROR_HEADERS and "content" in answer:
                    answer.setdefault("headers", _ERROR_HEADERS[status])
            op["responses"] = dict(sorted(responses.items()))
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(body.pop("$defs", {}))
    schemas[ERROR_SCHEMA_NAME] = body
    schema["components"]["schemas"] = dict(sorted(schemas.items()))
    return schema


def inference_openapi(endpoints: Sequence[tuple[str, type[BaseModel], str, str]]) -> dict[str, Any]:
    """OpenAPI path items of the inference endpoints (path, body model, summary,
    description each)."""
    paths: dict[str, Any] = {}
    for path, kind, summary, description in endpoints:
        responses: dict[str, Any] = {
            "200": {
                "description": "The engine's answer, as it gave it",
                "content": {"application/json": {"schema": {}}, "text/event-stream": {}},
            }
        }
        for code, meaning in _ERRORS.items():
            responses[code] = error_answer(meaning, code)
        paths[path] = {
            "post": {
                "tags": ["openai"],
                "summary": summary,
                "description": description,
                "operationId": path.strip("/").replace("/", "_"),
                **_openapi_body(kind),
                "responses": responses,
            }
        }
    return paths
