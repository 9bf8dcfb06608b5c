"""llama.cpp slot pinning in front of a real llama-server (catalog
``routing.slots``), through the official openai client: conversations that
share a system prompt, their turns interleaved on one replica, each find
their whole previous prompt cached. Left to the engine (the same server
flags, no ``id_slot``), a new turn takes the slot of another conversation
that shares the system prompt and overwrites its history."""

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from llmgw.types import RoutingPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from tests.e2e.test_prefix_routing import Engines, Turn, ask, conversation, routers, serving, turn
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
