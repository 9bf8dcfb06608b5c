"""The OpenAPI description states what the server answers (issue 24 §3): the
error answers each operation may give, in the OpenAI shape, and no 422 (our
handler answers 400). Read from the app itself; the live check of the same
document is tests/gateway/test_router_fuzz.py."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.store import Store
from router.app import create_app
from tests.gateway_util import ADMIN_KEY, FakeSource, serving

ERROR_REF = "#/components/schemas/ErrorBody"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    yield store
    store.close()


@pytest.fixture
def spec(store: Store) -> dict[str, Any]:
    return create_app(store, FakeSource([]), admin_key=ADMIN_KEY).openapi()


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in spec["paths"].items():
        for method, op in item.items():
            yield path, method, op


def test_no_operation_documents_422_and_validated_ones_document_400(
    spec: dict[str, Any],
) -> None:
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for path, method, op in _operations(spec):
        responses = op["responses"]
        assert "422" not in responses, (method, path)
        if op.get("parameters") or op.get("requestBody"):
            assert "400" in responses, (method, path)


def test_keyed_operations_document_401_and_path_parameters_404(spec: dict[str, Any]) -> None:
    with_404 = set()
    for path, method, op in _operations(spec):
        responses = op["responses"]
        assert {"401", "503"} <= responses.keys(), (method, path)
        if "404" in responses:
            with_404.add(f"{method.upper()} {path}")
        for status, answer in responses.items():
            if status.startswith(("4", "5")):
                schema = answer["content"]["application/json"]["schema"]
                assert schema == {"$ref": ERROR_REF}, (method, path, status)
    # Every operation that names a resource in its path, but a PUT (it makes one).
    assert {o for o in with_404 if " /admin/" in o} == {
        "GET /admin/models/{name}",
        "DELETE /admin/models/{name}",
        "POST /admin/models/{name}/scale",
        "GET /admin/replicas/{replica_id}/logs",
        "GET /admin/replicas/{replica_id}/engine-key",
        "GET /admin/errors/{error_id}",
        "GET /admin/keys/{key_id}",
        "DELETE /admin/keys/{key_id}",
        "PATCH /admin/keys/{key_id}",
    }
    # And the inference endpoints: no such model.
    assert {o for o in with_404 if " /v1/" in o} == {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/embeddings",
        # And a file of another key, or none (router/api/files.py).
        "GET /v1/files/{file_id}",
        "GET /v1/files/{file_id}/content",
        "DELETE /v1/files/{file_id}",
        # A batch of another key, or none; a create naming such an input file
        # (router/api/batches.py).
        "POST /v1/batches",
        "GET /v1/batches/{batch_id}",
        "POST /v1/batches/{batch_id}/cancel",
        "GET /v1/responses/{response_id}",
        "GET /v1/responses/{response_id}/input_items",
        "DELETE /v1/responses/{response_id}",
        "POST /v1/responses/{response_id}/cancel",
    }


async def test_a_put_naming_another_entry_is_documented_and_refused(
    spec: dict[str, Any], store: Store
) -> None:
    op = spec["paths"]["/admin/models/{name}"]["put"]
    assert "`name` must equal the path's" in op["description"]
    assert "`name` is not the path's" in op["responses"]["400"]["description"]
    (name,) = [p for p in op["parameters"] if p["name"] == "name"]
    assert "must be the same" in name["description"]
    async with serving(create_app(store, FakeSource([]), admin_key=ADMIN_KEY)) as http:
        r = await http.put(
            "/admin/models/a",
            json={"name": "b", "source": "hf://x/y"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "name"


def test_retry_after_and_the_error_id_are_documented_where_they_are_sent(
    spec: dict[str, Any],
) -> None:
    op = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"Retry-After", "x-request-id"} <= op["503"]["headers"].keys()
    assert "Retry-After" in op["429"]["headers"]
    assert "x-request-id" in op["502"]["headers"]
    # None is required: not every 503 carries them.
    assert not any(h.get("required") for h in op["503"]["headers"].values())
