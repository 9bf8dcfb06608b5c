"""The OpenAPI description of the inference endpoints.

They are plain ASGI endpoints that read the raw body (it is forwarded as
is), so FastAPI cannot derive their documentation: it is written out here,
for the docs and for schema-driven clients and tests.
"""

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel


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


_ERRORS = {
    "400": "Bad request: malformed JSON or an invalid field (`param` names it), or a media"
    " URL other than data: for a model that does not allow them (`remote_media_refused`)",
    "401": "Missing, unknown, revoked or expired API key",
    "403": "The key may not use this model",
    "404": "No such model",
    "408": "The request body did not arrive within LLMGW_BODY_TIMEOUT_S (`body_timeout`)",
    "413": "Request body too large",
    "429": "Quota exceeded (`Retry-After` says when to retry)",
    "502": "The engine failed",
    "503": "No ready replica, all are saturated and the queue is full or waited too long"
    " (`Retry-After`), or a model scaled to zero could not be woken",
}
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def inference_openapi(endpoints: Sequence[tuple[str, type[BaseModel], str, str]]) -> dict[str, Any]:
    """OpenAPI path items of the inference endpoints (path, body model, summary,
    description each)."""
    error = {"application/json": {"schema": _ERROR_SCHEMA}}
    paths: dict[str, Any] = {}
    for path, kind, summary, description in endpoints:
        responses: dict[str, Any] = {
            "200": {
                "description": "The engine's answer, as it gave it",
                "content": {"application/json": {"schema": {}}, "text/event-stream": {}},
            }
        }
        for code, meaning in _ERRORS.items():
            responses[code] = {"description": meaning, "content": error}
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
