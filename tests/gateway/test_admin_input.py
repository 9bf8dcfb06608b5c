"""The admin API's input, as schemathesis found it lax (issue 34): strict
types wherever the schema says integer, number or boolean (a string "5" for
``token_budget`` was taken), names without control characters (NUL was
taken), a revoked key's policy fixed (PATCH answered 200 and changed it;
now 409, stated in the OpenAPI document) and gone from ``GET`` (404), and
catalog integers the store's 32-bit columns hold (a huge ``gpus`` was a
500). The whole API under schemathesis: tests/gateway/test_schemathesis_run.py.
"""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from router.api.apikeys import get_key
from tests.gateway_util import ADMIN_KEY, Gateway, auth, gateway, ready, spec

ADMIN = auth(ADMIN_KEY)


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with gateway(tmp_path / "s.db", [ready("r1", "m1", "http://e1:1")], [spec("m1")]) as g:
        yield g


def _refused(answer: Any, param: str) -> None:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("token_budget", "5"),
        ("rpm", "5"),
        ("tpm", True),
        ("token_budget", 5.5),
        ("weight", "1.5"),
        ("expires_at", 0),
    ],
)
async def test_key_numbers_are_strict(gw: Gateway, field: str, value: object) -> None:
    made = await gw.http.post(
        "/admin/keys", json={"name": "k", "policy": {field: value}}, headers=ADMIN
    )
    _refused(made, f"policy.{field}")
    key_id, _ = gw.key()
    patched = await gw.http.patch(f"/admin/keys/{key_id}", json={field: value}, headers=ADMIN)
    _refused(patched, field)
    info = get_key(gw.store, key_id)
    assert info is not None and info.policy.token_budget == 0 and info.policy.rpm == 0
    # The same as numbers are taken.
    good = {"expires_at": "2100-01-01T00:00:00Z"} if field == "expires_at" else {field: 5}
    if field == "tpm":
        good = {"tpm": 5}
    ok = await gw.http.patch(f"/admin/keys/{key_id}", json=good, headers=ADMIN)
    assert ok.status_code == 200, ok.text


async def test_an_admin_flag_is_a_boolean(gw: Gateway) -> None:
    made = await gw.http.post(
        "/admin/keys", json={"name": "k", "policy": {"admin": "true"}}, headers=ADMIN
    )
    _refused(made, "policy.admin")


async def test_scale_counts_are_strict(gw: Gateway) -> None:
    answer = await gw.http.post("/admin/models/m1/scale", json={"replicas": "2"}, headers=ADMIN)
    _refused(answer, "replicas")


@pytest.mark.parametrize("name", ["a\x00b", "tab\there", "\x1f", "del\x7f", "line\n"])
async def test_key_names_have_no_control_characters(gw: Gateway, name: str) -> None:
    made = await gw.http.post("/admin/keys", json={"name": name}, headers=ADMIN)
    _refused(made, "name")
    key_id, _ = gw.key()
    patched = await gw.http.patch(f"/admin/keys/{key_id}", json={"name": name}, headers=ADMIN)
    _refused(patched, "name")
    # Printable names, Unicode included, are names.
    fine = await gw.http.post("/admin/keys", json={"name": "équipe 7 — prod"}, headers=ADMIN)
    assert fine.status_code == 201, fine.text


async def test_a_revoked_keys_policy_cannot_change(gw: Gateway) -> None:
    key_id, _ = gw.key(rpm=3)
    assert (await gw.http.delete(f"/admin/keys/{key_id}", headers=ADMIN)).status_code == 200
    answer = await gw.http.patch(
        f"/admin/keys/{key_id}", json={"rpm": 0, "name": "back"}, headers=ADMIN
    )
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "key_revoked"
    info = get_key(gw.store, key_id)
    assert info is not None and info.revoked and info.policy.rpm == 3 and info.name == "k"
    # Deleted: gone from GET, still listed (revoked) for its usage history.
    assert (await gw.http.get(f"/admin/keys/{key_id}", headers=ADMIN)).status_code == 404
    listed = (await gw.http.get("/admin/keys", headers=ADMIN)).json()
    assert [k["revoked"] for k in listed if k["id"] == key_id] == [True]
    # The OpenAPI document says so.
    document = (await gw.http.get("/openapi.json")).json()
    assert "409" in document["paths"]["/admin/keys/{key_id}"]["patch"]["responses"]


@pytest.mark.parametrize(
    ("field", "value"), [("gpus", "1"), ("context_length", "4096"), ("spread", "true")]
)
async def test_catalog_entries_are_strict(gw: Gateway, field: str, value: str) -> None:
    body: dict[str, object] = {"name": "m2", "source": "/m.gguf", field: value}
    _refused(await gw.http.put("/admin/models/m2", json=body, headers=ADMIN), field)
    body[field] = True if field == "spread" else int(value)
    answer = await gw.http.put("/admin/models/m2", json=body, headers=ADMIN)
    assert answer.status_code == 200, answer.text


async def test_catalog_integers_fit_the_store(gw: Gateway) -> None:
    body = {"name": "m2", "source": "/m.gguf", "gpus": 2**70}
    answer = await gw.http.put("/admin/models/m2", json=body, headers=ADMIN)
    _refused(answer, "gpus")
    body = {"name": "m2", "source": "/m.gguf", "context_length": 2**40}
    _refused(await gw.http.put("/admin/models/m2", json=body, headers=ADMIN), "context_length")
