"""llama.cpp slot pinning in front of a real llama-server (catalog
``routing.slots``), through the official openai client: conversations that
share a system prompt, their turns interleaved on one replica, each find
their whole previous prompt cached. Left to the engine (the same server
flags, no ``id_slot``), a new turn takes the slot of another conversation
that shares the system prompt and overwrites its history."""

import asyncio
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from llmgw.types import RoutingPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from tests.e2e.test_prefix_routing import (
    HOLD_TOKENS,
    Engines,
    M,
    Turn,
    ask,
    conversation,
    routers,
    serving,
    turn,
)
from worker_agent.engines.llamacpp import pinned_slot_flags

if TYPE_CHECKING:
    from worker_agent.installs.llamacpp import LlamaCppInstall

SLOTS = 3
CONTEXT = 8192  # split among the three slots


@pytest.fixture(scope="module")
def pinned_engine(
    llama: "LlamaCppInstall", tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """One llama.cpp server of the tiny model run as ``routing.slots: 3`` runs it."""
    root = tmp_path_factory.mktemp("slots")
    with serving(llama, tiny, root, ("s1",), CONTEXT, pinned_slot_flags(SLOTS)) as engines:
        yield engines


@pytest.mark.timeout(600)
async def test_interleaved_conversations_sharing_a_system_prompt_keep_their_histories(
    pinned_engine: Engines,
) -> None:
    routing = RoutingPolicy(slots=SLOTS)
    async with routers(pinned_engine, 1, routing, max_inflight=SLOTS) as ([r], key):
        client = r.client(key)
        talks = [conversation() for _ in range(SLOTS)]
        seen: list[list[Turn]] = [[] for _ in talks]
        for n in range(3):
            for who, messages in enumerate(talks):
                ask(messages, f"talk {who} question {n}: the green model and the blue sky")
                seen[who].append(await turn(client, messages))
        await client.close()
    for turns in seen:
        for before, after in itertools.pairwise(turns):
            # The whole previous prompt, from the conversation's own slot
            # (llama.cpp evaluates the last prompt token again at most).
            assert after.cached_tokens >= before.prompt_tokens - 1, seen


@pytest.fixture
def saving_engine(
    llama: "LlamaCppInstall", tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """The same server as the agent starts it with the shard's slot
    directory, its slots empty (one per test)."""
    root = tmp_path_factory.mktemp("saving")
    saves = root / "slots"
    saves.mkdir()
    flags = pinned_slot_flags(SLOTS, str(saves))
    with serving(llama, tiny, root, ("s2",), CONTEXT, flags) as engines:
        yield engines


@pytest.mark.timeout(600)
@pytest.mark.parametrize("primed", [True, False], ids=["primed", "prime_tokens_0"])
async def test_a_new_conversations_slot_is_primed_with_the_shared_system_prompt(
    saving_engine: Engines, primed: bool
) -> None:
    # The system prompt is ~130 estimated tokens: primed from 64 on.
    routing = RoutingPolicy(slots=SLOTS, prime_tokens=64 if primed else 0)
    async with routers(saving_engine, 1, routing, max_inflight=SLOTS) as ([r], key):
        client = r.client(key)
        firsts: list[Turn] = []
        talks = [conversation() for _ in range(SLOTS)]
        for who, messages in enumerate(talks):
            ask(messages, f"talk {who} opens: {'the green model ' * (who + 1)}and the blue sky")
            firsts.append(await turn(client, messages))
        seconds = []
        for who, messages in enumerate(talks):
            ask(messages, f"talk {who} goes on: the river light")
            seconds.append(await turn(client, messages))
        await client.close()
    # Each conversation's first turn went to an empty slot of its own:
    # primed (all but the first), the system prompt came from the slot copied
    # in (361 of the tiny model's tokens, the question the rest); unprimed,
    # nothing did. Either way each second turn found its whole first prompt
    # in its slot.
    assert firsts[0].cached_tokens == 0
    for first in firsts[1:]:
        if primed:
            assert first.prompt_tokens > first.cached_tokens > first.prompt_tokens // 2, firsts
        else:
            assert first.cached_tokens == 0, firsts
    for first, second in zip(firsts, seconds, strict=True):
        assert second.cached_tokens >= first.prompt_tokens - 1, (firsts, seconds)


@pytest.fixture
def two_slot_engine(
    llama: "LlamaCppInstall", tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """One server of the tiny model with two pinned slots, empty (one per test)."""
    root = tmp_path_factory.mktemp("shares")
    with serving(llama, tiny, root, ("s3",), CONTEXT, pinned_slot_flags(2)) as engines:
        yield engines


@pytest.mark.timeout(600)
async def test_two_routers_with_their_own_slot_shares_never_queue_behind_each_other(
    two_slot_engine: Engines,
) -> None:
    # One conversation asked through both routers at once (two questions on
    # one document). Without shares both routers, their tables empty, put
    # it in the same slot (its rendezvous choice, so routers agree), and
    # llama.cpp queues the second request behind the first for as long as
    # the first generates. With shares (router 0 pins slot 0, router 1 slot
    # 1) the second runs beside the first and is answered while it still streams.
    routing = RoutingPolicy(slots=2)
    async with routers(two_slot_engine, 2, routing, max_inflight=2, slot_shares=True) as (
        [a, b],
        key,
    ):
        long_client, short_client = a.client(key), b.client(key)
        messages = conversation()
        ask(messages, "one document: the green model and the blue sky")
        stream = await long_client.chat.completions.create(
            model=M, messages=messages, max_tokens=HOLD_TOKENS, stream=True
        )
        streamed, started = 0, asyncio.Event()

        async def read_long() -> None:
            nonlocal streamed
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    streamed += 1
                    started.set()

        reading = asyncio.create_task(read_long())
        await started.wait()  # generating on its slot now
        short = await short_client.chat.completions.create(model=M, messages=messages, max_tokens=4)
        assert short.choices[0].message.content
        # The short answer came while the long one was still being generated:
        # it did not wait for it (queued, it comes after all HOLD_TOKENS).
        assert streamed < HOLD_TOKENS // 2, streamed
        await reading
        assert streamed == HOLD_TOKENS
        await asyncio.gather(long_client.close(), short_client.close())
