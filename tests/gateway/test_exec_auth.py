"""The exec token (router/api/auth.py): the control worker's job activities
act for a key named by X-Llmgw-Key-Id; the batch class and billed-by-caller
headers count only with it."""

import asyncio
from pathlib import Path

from llmgw.engine_keys import exec_token
from router.api.apikeys import revoke_key
from router.billing import usage
from tests.gateway_util import Gateway, auth, gateway, ready, spec

M = "m1"
CHAT = "/v1/chat/completions"
BODY = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def exec_headers(gw: Gateway, key_id: int, **extra: str) -> dict[str, str]:
    return {
        **auth(exec_token(gw.store.engine_key_secret(), key_id)),
        "X-Llmgw-Key-Id": str(key_id),
        **extra,
    }


async def billed(gw: Gateway, key_id: int, requests: int) -> int:
    """The key's billed requests once they reach ``requests`` (or the timeout)."""
    async with asyncio.timeout(10):
        while True:
            rows = usage.query(gw.store, key_id=key_id)
            n = sum(r.requests for r in rows)
            if n >= requests:
                return n
            await asyncio.sleep(0.02)


async def test_the_exec_token_acts_for_the_named_key(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, _ = gw.key(models=[M])
        answer = await gw.http.post(CHAT, json=BODY, headers=exec_headers(gw, key_id))
        assert answer.status_code == 200, answer.text
        assert await billed(gw, key_id, 1) == 1  # billed to that key


async def test_the_exec_token_gets_the_keys_allow_list(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, _ = gw.key(models=["other"])
        answer = await gw.http.post(CHAT, json=BODY, headers=exec_headers(gw, key_id))
        assert answer.status_code == 403, answer.text


async def test_an_unknown_or_revoked_key_id_is_refused(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, _ = gw.key()
        revoke_key(gw.store, key_id)
        for bound, kid in ((key_id, None), (999, None), (key_id, "x"), (key_id, "")):
            headers = exec_headers(gw, bound)
            if kid is not None:
                headers["X-Llmgw-Key-Id"] = kid
            answer = await gw.http.post(CHAT, json=BODY, headers=headers)
            assert answer.status_code == 401, (bound, kid, answer.text)


async def test_a_wrong_token_with_a_key_id_is_refused(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, _ = gw.key()
        headers = {**auth(exec_token("not-the-secret", key_id)), "X-Llmgw-Key-Id": str(key_id)}
        answer = await gw.http.post(CHAT, json=BODY, headers=headers)
        assert answer.status_code == 401


async def test_billed_by_caller_writes_no_usage_row(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, _ = gw.key()
        headers = exec_headers(gw, key_id, **{"X-Llmgw-Billed-By-Caller": "1"})
        answer = await gw.http.post(CHAT, json=BODY, headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 0  # usage still answered
        # A request without the header after it: once it is billed, the first was not.
        answer = await gw.http.post(CHAT, json=BODY, headers=exec_headers(gw, key_id))
        assert answer.status_code == 200
        assert await billed(gw, key_id, 1) == 1


async def test_the_exec_headers_are_ignored_with_a_client_key(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        key_id, key = gw.key()
        other_id, _ = gw.key()
        headers = {
            **auth(key),
            "X-Llmgw-Key-Id": str(other_id),
            "X-Llmgw-Billed-By-Caller": "1",
            "X-Llmgw-Priority": "batch",
        }
        answer = await gw.http.post(CHAT, json=BODY, headers=headers)
        assert answer.status_code == 200, answer.text
        assert await billed(gw, key_id, 1) == 1  # billed, and to the key that sent it
        assert usage.query(gw.store, key_id=other_id) == []


async def test_a_key_id_asked_for_before_its_key_exists_is_not_remembered(tmp_path: Path) -> None:
    """Ids are sequential: the id the next key will get, asked for first, must
    not be refused from the negative cache once that key is made (a batch
    created right after its key failed validation on such a 401)."""
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e:1")], [spec(M)]) as gw:
        first, _ = gw.key(models=[M])
        early = await gw.http.post(CHAT, json=BODY, headers=exec_headers(gw, first + 1))
        assert early.status_code == 401, early.text
        made, _ = gw.key(models=[M])
        assert made == first + 1
        answer = await gw.http.post(CHAT, json=BODY, headers=exec_headers(gw, made))
        assert answer.status_code == 200, answer.text
