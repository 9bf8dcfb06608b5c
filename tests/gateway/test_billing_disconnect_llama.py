"""A client that leaves a non-streamed request to a real llama.cpp engine: the
engine generates on, and the key is billed every token it generated (before,
the prompt estimate alone). The router, uvicorn and the engine as in
tests/gateway/test_admission_llama.py; the official openai client."""

import asyncio

from router.api.apikeys import list_keys
from router.billing import usage
from tests.gateway.test_admission_llama import (
    LONG,
    LONG_TOKENS,
    Engine,
    ask,
    engine,
    model,
    router,
    until,
)

__all__ = ["engine"]


async def test_llama_cpp_left_mid_request_is_billed_what_it_generated(engine: Engine) -> None:
    async with router(engine, model()) as r:
        key = r.key()
        key_id = next(k.id for k in list_keys(r.store) if k.prefix == key[:14])
        async with r.client(key) as client:
            leaving = asyncio.create_task(ask(client, LONG_TOKENS, **LONG))
            await until(lambda: r.inflight() == 1)
            leaving.cancel()  # the client closes its connection mid-generation
        # The router waits for the engine's answer (its slot stays busy), then bills it.
        rows: list[usage.UsageRow] = []

        def billed() -> bool:
            rows[:] = usage.query(r.store, key_id=key_id)
            return bool(rows)

        await until(billed, timeout_s=120)
        assert r.inflight() == 0
        [row] = rows
        assert (row.requests, row.completion_tokens) == (1, LONG_TOKENS)
        assert row.prompt_tokens > 0
