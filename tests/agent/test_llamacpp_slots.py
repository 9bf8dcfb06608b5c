"""llama.cpp with ``routing.slots``: the engine plan's slot flags, run by
every install path (wheel, portable server, source build), keep each pinned
conversation's history when conversations share a system prompt.

Without them (llama-server's defaults) the second conversation's turn takes
the first one's slot for the prompt they share and overwrites its history;
an idle slot is cleared into the host-RAM cache, which pinned requests never
read (docs/guides/routing.md, "llama.cpp slots").
"""

import asyncio
import itertools
import os
from pathlib import Path
from typing import Any

import httpx

from llmgw.types import ModelSpec, RoutingPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from tests.conftest import LlamaPath
from tests.harness import free_port
from worker_agent.engines import Launchers, LlamaCppPlanner, NodeFacts, ShardRequest
from worker_agent.engines.llamacpp import pinned_slot_flags

KEY = "sk-engine-slots"
SYSTEM = "You answer questions about the shared handbook. " + " ".join(
    f"Rule {i}: keep the answer short and cite section {i}." for i in range(40)
)


def test_slots_set_the_servers_slot_flags_and_nothing_without() -> None:
    def argv(routing: RoutingPolicy) -> list[str]:
        request = ShardRequest(
            model=ModelSpec(name="m", source="/w/m.gguf", routing=routing),
            node=NodeFacts(host="127.0.0.1", advertise_address="127.0.0.1", http_port=9000),
        )
        (command,) = LlamaCppPlanner().plan(request, KEY, {}).commands
        return list(command.argv)

    pinned = argv(RoutingPolicy(slots=6))
    flags = pinned_slot_flags(6)
    at = pinned.index(flags[0])
    assert pinned[at : at + len(flags)] == ["--parallel", "6", "--no-cache-idle-slots"]
    # Each slot its own cache of the model's whole context (512 by default).
    assert pinned[pinned.index("--ctx-size") + 1] == str(512 * 6)
    plain = argv(RoutingPolicy())
    assert not {"--parallel", "--no-cache-idle-slots"} & set(plain)
    assert plain[plain.index("--ctx-size") + 1] == "512"


def test_slots_are_part_of_how_the_engine_runs_the_rest_of_routing_is_not() -> None:
    base = ModelSpec(name="m", source="/w/m.gguf")
    assert base.model_copy(update={"routing": RoutingPolicy(balance_slack=5)}).digest() == (
        base.digest()
    )
    assert base.model_copy(update={"routing": RoutingPolicy(slots=4)}).digest() != base.digest()


async def _turn(
    http: httpx.AsyncClient, messages: list[dict[str, str]], slot: int, text: str
) -> tuple[int, int]:
    """One turn of a conversation pinned to ``slot``: (prompt, cached) tokens."""
    messages.append({"role": "user", "content": text})
    body: dict[str, Any] = {"messages": messages, "max_tokens": 6, "id_slot": slot}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    usage = answer["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def test_pinned_conversations_sharing_a_system_prompt_keep_their_histories(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    install = llama_path.install
    port = free_port()
    request = ShardRequest(
        model=ModelSpec(
            name="tiny",
            source=str(tiny.model_path),
            context_length=4096,
            routing=RoutingPolicy(slots=3),
        ),
        node=NodeFacts(host="127.0.0.1", advertise_address="127.0.0.1", http_port=port, threads=1),
    )
    planner = LlamaCppPlanner(Launchers(llama_server=(str(install.server),)))
    plan = planner.plan(request, KEY, install.environment(os.environ))
    (command,) = plan.commands
    log = tmp_path / "engine.log"
    engine = Child("llama-server", list(command.argv), plan.env, log)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120
        ) as http:
            async with asyncio.timeout(120):
                while True:
                    assert engine.alive(), log.read_text(errors="replace")
                    try:
                        if (await http.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.2)
            assert len((await http.get("/slots")).json()) == 3
            talks: list[list[dict[str, str]]] = [
                [{"role": "system", "content": SYSTEM}] for _ in range(2)
            ]
            seen: list[list[tuple[int, int]]] = [[], []]
            for n in range(3):
                for who in (0, 1):
                    text = f"Conversation {who}, question {n}: what does rule {n + who} say?"
                    seen[who].append(await _turn(http, talks[who], who, text))
            for who, turns in enumerate(seen):
                for (before, _), (prompt, cached) in itertools.pairwise(turns):
                    # The whole previous prompt, found in the conversation's own
                    # slot after the other conversation's turn (llama.cpp evaluates
                    # the last prompt token again at most).
                    assert prompt > before and cached >= before - 1, (who, seen)
    finally:
        engine.stop(grace_s=5)
