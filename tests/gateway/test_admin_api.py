"""The admin API in process: its credential, catalog CRUD with errors naming the
field, keys shown once, replicas from the routing table, engine keys."""

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.engine_keys import engine_key
from llmgw.types import ReplicaMemo, ReplicaPhase
from router.api.apikeys import lookup
from tests.gateway_util import ADMIN_KEY, Gateway, auth, gateway, ready, spec

ADMIN = auth(ADMIN_KEY)


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    replicas = [
        ready("r1", "m1", "http://e1:1"),
        ReplicaMemo(replica_id="r2", model="m1", phase=ReplicaPhase.DRAINING, node_id="n1"),
    ]
    async with gateway(tmp_path / "s.db", replicas, [spec("m1")]) as g:
        yield g


@pytest.mark.parametrize(
    "path", ["/admin/models", "/admin/keys", "/admin/usage", "/admin/replicas"]
)
async def test_admin_needs_the_admin_key(gw: Gateway, path: str) -> None:
    _, client_key = gw.key()
    for headers in ({}, auth(client_key), auth("wrong")):
        r = await gw.http.get(path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
    _, stored_admin = gw.key(admin=True)
    assert (await gw.http.get(path, headers=auth(stored_admin))).status_code == 200
    assert (await gw.http.get(path, headers=ADMIN)).status_code == 200


async def test_catalog_crud_with_errors_naming_the_field(gw: Gateway) -> None:
    entry = {"name": "m2", "source": "/w.gguf", "replicas": 2, "profile": {"max_inflight": 4}}
    r = await gw.http.put("/admin/models/m2", json=entry, headers=ADMIN)
    assert r.status_code == 200, r.text
    got = (await gw.http.get("/admin/models/m2", headers=ADMIN)).json()
    assert got["replicas"] == 2 and got["profile"]["max_inflight"] == 4
    assert [m["name"] for m in (await gw.http.get("/admin/models", headers=ADMIN)).json()] == [
        "m1",
        "m2",
    ]
    for bad, field in [
        ({**entry, "replicas": -1}, "replicas"),
        ({**entry, "replcas": 1}, "replcas"),
        ({**entry, "profile": {"tp": 0}}, "profile.tp"),
        ({**entry, "name": "other"}, "name"),
    ]:
        r = await gw.http.put("/admin/models/m2", json=bad, headers=ADMIN)
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    assert (await gw.http.delete("/admin/models/m2", headers=ADMIN)).status_code == 200
    r = await gw.http.get("/admin/models/m2", headers=ADMIN)
    assert r.status_code == 404 and "error" in r.json()


async def test_adapter_names_share_the_models_namespace(gw: Gateway) -> None:
    lora = {"name": "m2", "source": "/w.gguf", "adapters": [{"name": "sql", "source": "/a"}]}
    assert (await gw.http.put("/admin/models/m2", json=lora, headers=ADMIN)).status_code == 200
    clashes = [
        # An adapter named as a model, as another model's adapter; a model named as an adapter.
        ("m3", {**lora, "name": "m3", "adapters": [{"name": "m1", "source": "/a"}]}, "m1"),
        ("m3", {**lora, "name": "m3"}, "sql"),
        ("sql", {"name": "sql", "source": "/w.gguf"}, "sql"),
        # Runtime loading is vLLM's alone.
        ("m3", {"name": "m3", "source": "/w.gguf", "profile": {"runtime_lora": True}}, "vLLM"),
    ]
    for name, entry, named in clashes:
        r = await gw.http.put(f"/admin/models/{name}", json=entry, headers=ADMIN)
        assert r.status_code == 400, (entry, r.text)
        assert named in r.json()["error"]["message"]
    # Replacing the entry with its own adapters is no clash.
    assert (await gw.http.put("/admin/models/m2", json=lora, headers=ADMIN)).status_code == 200


async def test_keys_are_shown_once_and_stored_hashed(gw: Gateway) -> None:
    r = await gw.http.post(
        "/admin/keys", json={"name": "team", "policy": {"models": ["m1"], "rpm": 3}}, headers=ADMIN
    )
    assert r.status_code == 201
    made = r.json()
    assert made["key"].startswith("sk-llmgw-")
    found = lookup(gw.store, made["key"])
    assert found is not None and found.policy.rpm == 3
    listed = (await gw.http.get("/admin/keys", headers=ADMIN)).text
    assert made["key"] not in listed and '"name":"team"' in listed
    bad = await gw.http.post(
        "/admin/keys", json={"name": "x", "policy": {"rpm": -1}}, headers=ADMIN
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "policy.rpm"
    assert (await gw.http.delete("/admin/keys/999", headers=ADMIN)).status_code == 404


async def test_a_key_is_changed_in_place_and_the_router_applies_it_at_once(
    gw: Gateway,
) -> None:
    key_id, key = gw.key(models=["m2"], rpm=5)
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    r = await gw.http.post("/v1/chat/completions", json=chat, headers=auth(key))
    assert r.status_code == 403  # (and now cached as such)
    r = await gw.http.patch(
        f"/admin/keys/{key_id}",
        json={"name": "renamed", "models": [], "tpm": 10**5, "expires_at": "2999-01-01T00:00:00Z"},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    policy = r.json()["policy"]
    assert r.json()["name"] == "renamed"
    assert (policy["models"], policy["rpm"], policy["tpm"]) == ([], 5, 10**5)  # rpm kept
    assert policy["expires_at"].startswith("2999-01-01")
    r = await gw.http.post("/v1/chat/completions", json=chat, headers=auth(key))
    assert r.status_code == 200, r.text
    # An explicit null removes the expiry; what is not named stays.
    r = await gw.http.patch(f"/admin/keys/{key_id}", json={"expires_at": None}, headers=ADMIN)
    assert r.json()["policy"]["expires_at"] is None and r.json()["policy"]["tpm"] == 10**5
    found = lookup(gw.store, key)
    assert found is not None and found.name == "renamed" and found.policy.expires_at is None
    for bad, field in [({"rpm": -1}, "rpm"), ({"admin": True}, "admin"), ({"name": ""}, "name")]:
        r = await gw.http.patch(f"/admin/keys/{key_id}", json=bad, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert (await gw.http.patch("/admin/keys/999", json={}, headers=ADMIN)).status_code == 404
    # Past its (new) expiry the key is refused here at once.
    r = await gw.http.patch(
        f"/admin/keys/{key_id}", json={"expires_at": "2000-01-01T00:00:00Z"}, headers=ADMIN
    )
    assert r.status_code == 200
    r = await gw.http.post("/v1/chat/completions", json=chat, headers=auth(key))
    assert r.status_code == 401 and r.json()["error"]["code"] == "expired_api_key", r.text


async def test_replicas_and_engine_keys(gw: Gateway) -> None:
    reps = {
        r["replica_id"]: r for r in (await gw.http.get("/admin/replicas", headers=ADMIN)).json()
    }
    assert reps["r1"]["phase"] == "ready" and reps["r2"]["phase"] == "draining"
    r = await gw.http.get("/admin/replicas/r1/engine-key", headers=ADMIN)
    assert r.json() == {
        "replica_id": "r1",
        "endpoint": "http://e1:1",
        "engine_key": engine_key(gw.store.engine_key_secret(), "r1"),
    }
    assert (await gw.http.get("/admin/replicas/nope/engine-key", headers=ADMIN)).status_code == 404
    # Without a Temporal client, what needs one says so in the OpenAI shape.
    r = await gw.http.get("/admin/nodes", headers=ADMIN)
    assert r.status_code == 503 and "Temporal" in r.json()["error"]["message"]


async def test_draining_replicas_get_nothing(gw: Gateway) -> None:
    _, key = gw.key()
    for _ in range(4):
        r = await gw.http.post(
            "/v1/completions", json={"model": "m1", "prompt": "x"}, headers=auth(key)
        )
        assert r.headers["x-llmgw-replica"] == "r1"


async def test_openapi_docs_are_served(gw: Gateway) -> None:
    assert "swagger" in (await gw.http.get("/docs")).text.lower()
    schema = (await gw.http.get("/openapi.json")).json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in str(body)
    assert "/admin/replicas/{replica_id}/engine-key" in schema["paths"]


async def test_the_admin_errors_have_a_schema(gw: Gateway) -> None:
    # The API reference documents an incident's fields, not a bare object.
    schema = (await gw.http.get("/openapi.json")).json()
    incident = schema["components"]["schemas"]["Incident"]
    assert set(incident["properties"]) == {"error_id", "at", "status", "code", "model", "reason"}
    for path in ("/admin/errors", "/admin/errors/{error_id}"):
        ok = schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]
        assert "Incident" in json.dumps(ok["schema"]), (path, ok)
