"""The exec token's reach (issue 34): it is bound to one key (the job's
owner: ``llmgw-exec-<key_id>-<HMAC>``), acts as that key only, only on the
inference endpoints (and the executor's own), and its calls are billed to
that key.

Before, one token (an HMAC of the store's secret) acted as whatever key
``X-Llmgw-Key-Id`` named, on every endpoint a client key opens: files,
batches, models, Responses.
"""

import asyncio
from pathlib import Path

import pytest

from llmgw.engine_keys import exec_key_id, exec_token
from router.billing import usage
from tests.gateway_util import Gateway, auth, gateway, ready, spec

M = "m1"
CHAT = "/v1/chat/completions"
BODY = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def token(gw: Gateway, key_id: int) -> dict[str, str]:
    return auth(exec_token(gw.store.engine_key_secret(), key_id))


async def billed(gw: Gateway, key_id: int, requests: int) -> int:
    async with asyncio.timeout(10):
        while True:
            n = sum(r.requests for r in usage.query(gw.store, key_id=key_id))
            if n >= requests:
                return n
            await asyncio.sleep(0.02)


def test_a_token_names_its_key_and_no_other() -> None:
    secret = "s" * 64
    made = exec_token(secret, 7)
    assert exec_key_id(secret, made) == 7
    assert exec_key_id("other" * 13, made) is None
    mac = made.rsplit("-", 1)[1]
    for forged in (f"llmgw-exec-8-{mac}", f"llmgw-exec-07-{mac}", made[:-1], made + "0"):
        assert exec_key_id(secret, forged) is None, forged


async def test_the_token_acts_as_its_own_key_only_and_is_billed_to_it(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        mine, _ = gw.key()
        other, _ = gw.key()
        # Naming another key: refused (before, the token acted as the key named).
        refused = await gw.http.post(
            CHAT, json=BODY, headers={**token(gw, mine), "X-Llmgw-Key-Id": str(other)}
        )
        assert refused.status_code == 401, refused.text
        # Its own key, named or not: served, and a usage row for that key.
        for named in ({"X-Llmgw-Key-Id": str(mine)}, {}):
            answer = await gw.http.post(CHAT, json=BODY, headers={**token(gw, mine), **named})
            assert answer.status_code == 200, answer.text
        assert await billed(gw, mine, 2) == 2
        assert usage.query(gw.store, key_id=other) == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/files"),
        ("POST", "/v1/files"),
        ("GET", "/v1/files/file-x"),
        ("GET", "/v1/files/file-x/content"),
        ("DELETE", "/v1/files/file-x"),
        ("GET", "/v1/batches"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches/batch_x"),
        ("POST", "/v1/batches/batch_x/cancel"),
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
        ("GET", "/admin/keys"),
        ("POST", "/admin/keys"),
        ("GET", "/metrics"),
    ],
)
async def test_the_token_is_refused_off_the_inference_endpoints(
    tmp_path: Path, method: str, path: str
) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, _ = gw.key()
        answer = await gw.http.request(method, path, headers=token(gw, key_id), json={})
        assert answer.status_code == 403, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("permission_error", "exec_token_not_allowed")
        # The inference endpoints take it.
        served = await gw.http.post(CHAT, json=BODY, headers=token(gw, key_id))
        assert served.status_code == 200, served.text


async def test_a_token_of_another_secret_is_no_token(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, _ = gw.key()
        forged = auth(exec_token("not-the-secret", key_id))
        assert (await gw.http.post(CHAT, json=BODY, headers=forged)).status_code == 401
        assert (await gw.http.get("/v1/models", headers=forged)).status_code == 401
