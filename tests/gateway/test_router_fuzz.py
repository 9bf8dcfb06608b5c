"""Fuzz the router's OpenAPI schema (schemathesis) against a live router: valid
and invalid inputs alike, never a 5xx, every error OpenAI-shaped, invalid input
a 4xx, and every answer as the description says (its status, content type,
headers and body schema: the description is what the API reference is made
of). A 405 names the methods that path takes (Allow). Bounded and
deterministic: a fixed number of examples per operation, derandomized, the
engine scripted (no real inference)."""

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig
from schemathesis.schemas import BaseSchema

from llmgw_cli.procs import wait_for
from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from tests.gateway_util import ADMIN_KEY, MockEngine, MockUpstream, ready, spec
from tests.harness import free_port, port_open

MAX_EXAMPLES = 25


@dataclass
class _Served:
    root: str
    key: str
    key_id: int
    engine: MockEngine


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Served]:
    """A router in a thread of its own (uvicorn), in front of a scripted engine."""
    from llmgw.store import Store  # noqa: PLC0415
    from router.app import create_app  # noqa: PLC0415
    from tests.gateway_util import FakeSource  # noqa: PLC0415

    db = tmp_path_factory.mktemp("fuzz") / "s.db"
    store = Store(f"sqlite:///{db}")
    store.migrate()
    store.put_model(spec("m1"))
    info, key = create_key(store, "fuzz", KeyPolicy())
    engine = MockEngine()
    app = create_app(
        store,
        FakeSource([ready("r1", "m1", "http://e1:1")]),
        refresh_interval_s=0.05,
        http=MockUpstream(engine),
        admin_key=ADMIN_KEY,
        max_request_bytes=64 * 1024,
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    assert wait_for(lambda: port_open(port), 30)
    yield _Served(f"http://127.0.0.1:{port}", key, info.id, engine)
    server.should_exit = True
    thread.join(10)
    store.close()


@pytest.fixture(scope="module")
def api_schema(served: _Served) -> BaseSchema:
    config = SchemathesisConfig.from_dict(
        {"generation": {"mode": "all", "max-examples": MAX_EXAMPLES}}
    )
    return schemathesis.openapi.from_url(f"{served.root}/openapi.json", config=config)


# Without Temporal these answer 503 (documented: checked for conformance, not
# for "no 5xx"); tests/e2e/test_gateway_e2e.py and test_elastic_cli.py serve them.
NEEDS_TEMPORAL = {"/admin/nodes", "/admin/models/{name}/scale", "/admin/replicas/{replica_id}/logs"}


def _served_model(served: _Served) -> Callable[[Case[Any]], Case[Any]]:
    def adjust(case: Case[Any]) -> Case[Any]:
        # A random model name is a 404: valid bodies name the served model so
        # they go the whole way to the engine.
        meta = case.meta
        positive = meta is not None and meta.generation.mode is GenerationMode.POSITIVE
        if positive and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "m1"
        # Deleting the served model or revoking the fuzzing key would only turn
        # the cases after it into 404s and 401s: they name one that is not there.
        params = case.path_parameters or {}
        if case.method == "DELETE" and params.get("name") == "m1":
            params["name"] = "m1-not-served"
        if case.method in ("DELETE", "PATCH") and params.get("key_id") == served.key_id:
            params["key_id"] = served.key_id + 1000
        return case

    return adjust


def _check(case: Case[Any], served: _Served) -> None:
    key = ADMIN_KEY if case.path.startswith("/admin") else served.key
    # not_a_server_error: no 5xx; negative_data_rejection: input against the
    # schema gets a 4xx (schemathesis knows when its mutation is still valid);
    # the *_conformance checks: the answer is one the description documents.
    checks = [
        negative_data_rejection,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    if case.path not in NEEDS_TEMPORAL:
        checks.append(not_a_server_error)
    response = case.call_and_validate(
        base_url=served.root, headers={"Authorization": f"Bearer {key}"}, checks=checks
    )
    if response.status_code >= 400:
        where = (case.method, case.path, case.body, response.text[:300])
        error: Any = response.json().get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str), where
        assert {"type", "code", "param"} <= error.keys(), where


def test_fuzz_the_openapi_schema(api_schema: BaseSchema, served: _Served) -> None:
    operations = [r.ok() for r in api_schema.get_all_operations()]  # type: ignore[union-attr]
    # Deletions last: what they remove, no later case needs.
    operations.sort(key=lambda op: op.method.upper() == "DELETE")
    labels = {op.label for op in operations}
    assert {
        "POST /v1/chat/completions",
        "POST /v1/embeddings",
        "GET /v1/models",
        "PUT /admin/models/{name}",
        "DELETE /admin/keys/{key_id}",
        "POST /admin/models/{name}/scale",
    } <= labels
    for operation in operations:
        for mode in GenerationMode:

            @given(case=operation.as_strategy(generation_mode=mode).map(_served_model(served)))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Case[Any]) -> None:
                _check(case, served)

            try:
                run()
            except Unsatisfiable:
                # Nothing to make invalid (an operation without inputs).
                assert mode is GenerationMode.NEGATIVE, operation.label
    # Valid requests went through to the engine, on every inference path.
    assert {r.url.path for r in served.engine.seen} == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
    }


def test_fuzz_raw_bodies_are_400_and_oversize_413(served: _Served) -> None:
    headers = {"Authorization": f"Bearer {served.key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=served.root, headers=headers) as http:

        @given(body=st.binary(max_size=512) | st.text(max_size=256).map(str.encode))
        @settings(max_examples=100, deadline=None, database=None, derandomize=True)
        def run(body: bytes) -> None:
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
                r = http.post(path, content=body)
                assert r.status_code == 400, (path, body, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"

        run()
        big = b'{"model": "m1", "prompt": "' + b"x" * (64 * 1024) + b'"}'
        r = http.post("/v1/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_a_405_says_which_methods_the_path_takes(api_schema: BaseSchema, served: _Served) -> None:
    # RFC 9110: a 405 carries Allow, listing what the resource supports: here
    # exactly the methods the description documents for that path.
    spec = api_schema.raw_schema
    paths = spec["paths"]
    assert any(p.startswith("/v1/") for p in paths) and any(p.startswith("/admin/") for p in paths)
    methods = ("GET", "POST", "PUT", "PATCH", "DELETE")
    with httpx.Client(base_url=served.root) as http:
        for template, item in paths.items():
            documented = {m.upper() for m in item} & set(methods)
            path = template.replace("{name}", "m1").replace("{key_id}", "1")
            path = re.sub(r"\{[a-z_]+\}", "x", path)
            key = ADMIN_KEY if path.startswith("/admin") else served.key
            for method in sorted(set(methods) - documented):
                r = http.request(method, path, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 405, (method, path, r.status_code)
                allow = {m.strip() for m in r.headers.get("allow", "").split(",") if m.strip()}
                assert allow == documented, (method, path, r.headers.get("allow"))
                assert r.json()["error"]["message"] == "Method Not Allowed"
