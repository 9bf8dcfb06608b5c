"""Batch-class admission in front of a real llama.cpp engine (one slot),
driven by the official openai client: batch lines (the exec token with
X-Llmgw-Priority: batch, as the control worker sends them) queued before
interactive requests are served after them."""

import asyncio
from typing import Any

import openai

from llmgw.engine_keys import exec_token
from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from tests.gateway.test_admission_llama import (
    LONG,
    LONG_TOKENS,
    Engine,
    M,
    engine,
    model,
    router,
    until,
)

__all__ = ["engine"]  # the module fixture: one llama.cpp server


async def chat(
    client: openai.AsyncOpenAI, tag: str, done: list[str], tokens: int = 8, **extra: Any
) -> None:
    await client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": tag}], max_tokens=tokens,
        extra_body=extra or None,
    )  # fmt: skip
    done.append(tag)


async def test_interactive_requests_go_before_queued_batch_lines(engine: Engine) -> None:
    async with router(engine, model(max_wait_s=120, batch_headroom=0)) as r:
        info, key = create_key(r.store, "k", KeyPolicy())
        interactive = r.client(key)
        batch = openai.AsyncOpenAI(
            base_url=f"{r.base}/v1",
            api_key=exec_token(engine.secret, info.id),
            max_retries=0,
            default_headers={"X-Llmgw-Key-Id": str(info.id), "X-Llmgw-Priority": "batch"},
        )
        done: list[str] = []
        async with interactive, batch:
            held = asyncio.create_task(chat(interactive, "held", done, LONG_TOKENS, **LONG))
            await until(lambda: r.inflight() == 1)
            lines = [asyncio.create_task(chat(batch, f"b{i}", done)) for i in range(3)]
            await until(lambda: r.waiting() == 3)
            late = [asyncio.create_task(chat(interactive, f"i{i}", done)) for i in range(2)]
            await until(lambda: r.waiting() == 5)
            await asyncio.gather(held, *lines, *late)
        assert done[0] == "held"
        assert sorted(done[1:3]) == ["i0", "i1"]  # the interactive ones, though later
        assert sorted(done[3:]) == ["b0", "b1", "b2"]
