"""Issue 23 item 6: API clients get a fixed message, the error code and an
error id (in the message and the ``x-request-id`` header) for failures
inside the system; the full reason (node names, paths, exception text, an
engine's log) is in the router's log line with that id and in the admin API,
never in the client's body."""

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest

from llmgw.types import WakeResult
from tests.gateway.test_admission import FakeLink, elastic, post, until, waiting
from tests.gateway_util import ADMIN_KEY, MockEngine, auth, gateway, ready, spec

M = "m1"
CHAT = "/v1/chat/completions"
ENGINE_KEY = "sk-engine-0123456789abcdef"
# What a failed wake's reason may carry: a node, a path, an exception, a log tail.
INTERNALS = [
    "gpu-node-7",
    "/var/lib/llmgw/weights/secret-model.gguf",
    "RuntimeError",
    "server_args=ServerArgs",
    ENGINE_KEY,
]
REASON = (
    "replica tiny-1 failed on gpu-node-7: engine exited with code 1 while loading;"
    " log tail:\nserver_args=ServerArgs(model_path='/var/lib/llmgw/weights/secret-model.gguf',"
    f" api_key='{ENGINE_KEY}')\nRuntimeError: CUDA out of memory"
)


def assert_no_internals(text: str) -> None:
    for secret in INTERNALS:
        assert secret not in text, (secret, text)


async def admin_reason(http: httpx.AsyncClient, error_id: str) -> dict[str, object]:
    r = await http.get(f"/admin/errors/{error_id}", headers=auth(ADMIN_KEY))
    assert r.status_code == 200, r.text
    found: dict[str, object] = r.json()
    return found


async def test_a_failed_wake_gives_clients_an_id_and_admins_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    link = FakeLink()
    async with gateway(tmp_path / "s.db", [], [elastic()], deployment_link=link) as gw:
        _, key = gw.key()
        gw.app.state.deps.admission.stream_quiet_s = 0.0  # a waiting stream gets its 200 at once
        plain = post(gw, key)
        streamed = post(gw, key, stream=True)
        await until(lambda: waiting(gw) == 2 and link.answer is not None)
        assert link.answer is not None
        with caplog.at_level(logging.WARNING, logger="router.common.errors"):
            link.answer.set_result(WakeResult(ready=False, reason=REASON))
            r, s = await asyncio.gather(plain, streamed)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "wake_failed" and error["type"] == "service_unavailable_error"
        error_id = r.headers["x-request-id"]
        assert error_id.startswith("err_") and error_id in error["message"]
        assert_no_internals(r.text)
        # The stream (200 already sent) ends with the same error event.
        last = s.text.strip().splitlines()[-1]
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "wake_failed"
        assert error_id in last
        assert_no_internals(s.text)
        # The admin sees why; the client key does not get in.
        found = await admin_reason(gw.http, error_id)
        assert found["reason"] == REASON and found["code"] == "wake_failed"
        assert found["model"] == M and found["status"] == 503
        refused = await gw.http.get(f"/admin/errors/{error_id}", headers=auth(key))
        assert refused.status_code == 401
        listed = await gw.http.get("/admin/errors", headers=auth(ADMIN_KEY))
        assert [e["error_id"] for e in listed.json()] == [error_id]
    # The router's log line has both the id and the full reason.
    lines = [rec.getMessage() for rec in caplog.records if error_id in rec.getMessage()]
    assert len(lines) == 1 and REASON in lines[0], lines


class FailingEngine(MockEngine):
    """An engine answering 500 with what engines put there: paths, exceptions."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return httpx.Response(
            500,
            json={
                "error": {
                    "code": 500,
                    "message": "RuntimeError: failed to open"
                    " /var/lib/llmgw/weights/secret-model.gguf on gpu-node-7",
                    "type": "server_error",
                }
            },
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_5xx_reaches_the_client_without_its_text(
    tmp_path: Path, stream: bool
) -> None:
    replicas = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", replicas, [spec(M)], FailingEngine()) as gw:
        _, key = gw.key()
        body = {"model": M, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        r = await gw.http.post(CHAT, json=body, headers=auth(key))
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "engine_error" and error["type"] == "server_error"
        assert_no_internals(r.text)
        error_id = r.headers["x-request-id"]
        assert error_id in error["message"]
        found = await admin_reason(gw.http, error_id)
        assert "secret-model.gguf on gpu-node-7" in str(found["reason"])
        assert "r1" in str(found["reason"])


async def test_an_unreachable_engine_gives_an_id_the_admin_can_look_up(tmp_path: Path) -> None:
    engine = MockEngine(down={"e1"})
    replicas = [ready("r-secret-1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", replicas, [spec(M)], engine) as gw:
        _, key = gw.key()
        body = {"model": M, "messages": [{"role": "user", "content": "hi"}]}
        r = await gw.http.post(CHAT, json=body, headers=auth(key))
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert "r-secret-1" not in r.text and "e1" not in r.text
        found = await admin_reason(gw.http, r.headers["x-request-id"])
        assert "r-secret-1" in str(found["reason"])
        missing = await gw.http.get("/admin/errors/err_nope", headers=auth(ADMIN_KEY))
        assert missing.status_code == 404
