"""What a request reserves of its key's token quota: every token the engine
may generate (llama.cpp's ``n_predict`` winning over ``max_tokens``, ``n``,
``best_of``, several prompts), and a burst against a token quota through the
real router app, on SQLite and PostgreSQL."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from router.api.reservation import CHAT_BASE_TOKENS, CHAT_MESSAGE_TOKENS, reserved_tokens
from router.api.schemas import ChatCompletionRequest, CompletionRequest
from tests.gateway_util import MockEngine, auth, gateway, ready, spec

M = "m1"
CONTEXT = 512
# "hi": one token's worth of bytes, and the chat template's allowance.
CHAT_PROMPT = 1 + CHAT_BASE_TOKENS + CHAT_MESSAGE_TOKENS


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": M, "messages": [{"role": "user", "content": "hi"}], **extra}


def chat(**extra: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(chat_body(**extra))


def completion(prompt: object, **extra: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": M, "prompt": prompt, **extra})


@pytest.mark.parametrize(
    ("fields", "generated"),
    [
        ({}, CONTEXT),  # no bound: up to the context
        ({"max_tokens": 10}, 10),
        ({"max_completion_tokens": 10}, 10),
        # llama.cpp obeys n_predict, then max_completion_tokens, vLLM the
        # latter: the larger of what the client sent is reserved.
        ({"max_tokens": 1, "n_predict": 50}, 50),
        ({"max_tokens": 50, "n_predict": 1}, 50),
        ({"max_tokens": 7, "max_completion_tokens": 3}, 7),
        ({"n_predict": 0}, 1),  # llama.cpp still generates one token
        ({"n_predict": 100_000}, CONTEXT),  # the context bounds it
        ({"n_predict": -1}, CONTEXT),  # until the context is full
        ({"max_tokens": 10, "n": 3}, 30),
        ({"max_tokens": 10, "n_cmpl": 4}, 40),  # llama.cpp's name for n
        ({"max_tokens": 10, "n": 2, "best_of": 5}, 50),
        ({"n_predict": 20, "n": 2}, 40),
    ],
)
def test_chat_reserves_every_token_the_engine_may_generate(
    fields: dict[str, object], generated: int
) -> None:
    assert reserved_tokens(chat(**fields), CONTEXT) == CHAT_PROMPT + generated


def test_completions_reserve_for_each_prompt() -> None:
    one = reserved_tokens(completion("abcd", max_tokens=10), CONTEXT)
    assert one == 2 + 4 + 10
    # Three prompts are three completions (each n times).
    three = reserved_tokens(completion(["ab", "cd", "ef"], max_tokens=10, n=2), CONTEXT)
    assert three == 3 + 4 + 3 * 2 * 10
    ids = reserved_tokens(completion([[1, 2], [3]], n_predict=5), CONTEXT)
    assert ids == 3 + 4 + 2 * 5
    assert reserved_tokens(completion([1, 2, 3], max_completion_tokens=6), CONTEXT) == 3 + 4 + 6


class LlamaLikeEngine(MockEngine):
    """Generates what llama.cpp would (n_predict first, n choices for each
    prompt, -1 up to the context) and counts every token it spent."""

    PROMPT = 9

    def __init__(self) -> None:
        super().__init__(hold=asyncio.Event())
        self.spent = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        assert self.hold is not None
        await self.hold.wait()
        data = json.loads(request.content)
        limit = next(
            (data[f] for f in ("n_predict", "max_completion_tokens", "max_tokens") if f in data),
            -1,
        )
        per_choice = CONTEXT - self.PROMPT if limit < 0 else max(1, limit)
        choices = max(data.get("n") or 1, data.get("n_cmpl") or 1)
        generated = per_choice * choices
        self.spent += self.PROMPT + generated
        usage = {
            "prompt_tokens": self.PROMPT,
            "completion_tokens": generated,
            "total_tokens": self.PROMPT + generated,
        }
        return httpx.Response(200, json={"object": "chat.completion", "usage": usage})


async def test_a_burst_with_n_predict_stays_within_a_token_quota(store_url: str) -> None:
    """40 concurrent requests asking llama.cpp for 50 tokens twice over (with
    a max_tokens of 1 it ignores) against 2,000 tokens a minute: what the
    engine spends stays within the quota plus one reservation."""
    tpm = 2000
    engine = LlamaLikeEngine()
    replicas, models = [ready("r1", M, "http://e1:1")], [spec(M, context_length=CONTEXT)]
    async with gateway(store_url, replicas, models, engine) as gw:
        _, key = gw.key(tpm=tpm)
        body = chat_body(max_tokens=1, n_predict=50, n=2)
        reservation = CHAT_PROMPT + 2 * 50
        burst = [
            asyncio.create_task(gw.http.post("/v1/chat/completions", json=body, headers=auth(key)))
            for _ in range(40)
        ]
        # Each is refused or waits in the engine: every reservation held at once.
        async with asyncio.timeout(30):
            while sum(t.done() for t in burst) + len(engine.seen) < len(burst):
                await asyncio.sleep(0.01)
        assert engine.hold is not None
        engine.hold.set()
        results = await asyncio.gather(*burst)
        await gw.app.state.deps.accountant.flush()
    statuses = [r.status_code for r in results]
    assert engine.spent <= tpm + reservation, (engine.spent, statuses.count(200))
    assert statuses.count(200) == tpm // reservation
    assert statuses.count(429) == len(burst) - tpm // reservation


async def test_fields_the_reservation_cannot_bound_are_refused(tmp_path: Path) -> None:
    replicas, models = [ready("r1", M, "http://e1:1")], [spec(M, context_length=CONTEXT)]
    async with gateway(tmp_path / "s.db", replicas, models) as gw:
        _, quota_key = gw.key(token_budget=100_000)
        _, rpm_key = gw.key(rpm=1000)
        _, free_key = gw.key()
        path = "/v1/chat/completions"
        invalid: list[tuple[dict[str, object], str]] = [
            ({"n_predict": -2}, "n_predict"),
            ({"n_predict": "fifty"}, "n_predict"),
            ({"max_tokens": 2.5}, "max_tokens"),
            ({"n": 0}, "n"),
            ({"best_of": 129}, "best_of"),
            ({"n_cmpl": -1}, "n_cmpl"),
            ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ]
        for fields, param in invalid:
            r = await gw.http.post(path, json=chat_body(**fields), headers=auth(free_key))
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param
        # Unbounded by request: refused only where tokens are counted.
        unbounded = chat_body(n_predict=-1)
        r = await gw.http.post(path, json=unbounded, headers=auth(quota_key))
        assert r.status_code == 400 and r.json()["error"]["param"] == "n_predict"
        assert "n_predict" in r.json()["error"]["message"]
        for key in (free_key, rpm_key):
            r = await gw.http.post(path, json=unbounded, headers=auth(key))
            assert r.status_code == 200, r.text
        # More than the key's whole quota could ever admit: 400, not a 429 to retry.
        _, small_key = gw.key(tpm=500)
        r = await gw.http.post(path, json=chat_body(n=8, max_tokens=64), headers=auth(small_key))
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "request_exceeds_quota", r.text
        assert "500 tokens per minute" in error["message"] and "retry-after" not in r.headers
        r = await gw.http.post(path, json=chat_body(max_tokens=64), headers=auth(small_key))
        assert r.status_code == 200, r.text
