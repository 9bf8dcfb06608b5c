"""llama.cpp with ``routing.slots``: the engine plan's slot flags, run by
every install path (wheel, portable server, source build), keep each pinned
conversation's history when conversations share a system prompt.

Without them (llama-server's defaults) the second conversation's turn takes
the first one's slot for the prompt they share and overwrites its history;
an idle slot is cleared into the host-RAM cache, which pinned requests never
read (docs/guides/routing.md, "llama.cpp slots").
"""

import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from llmgw.types import ModelSpec, RoutingPolicy
from llmgw.types.model import AUTO_SLOTS, AUTO_SLOTS_KV_TOKENS
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from router.forwarding.slot_priming import PRIME_FILE, SlotPrimer
from router.forwarding.upstream import AiohttpUpstream, UpstreamResponse
from tests.conftest import LlamaPath
from tests.harness import free_port
from worker_agent.engines import Launchers, LlamaCppPlanner, NodeFacts, ShardRequest
from worker_agent.engines.llamacpp import pinned_slot_flags
from worker_agent.engines.spec import SLOTS_SUBDIR

KEY = "sk-engine-slots"
SYSTEM = "You answer questions about the shared handbook. " + " ".join(
    f"Rule {i}: keep the answer short and cite section {i}." for i in range(40)
)


def test_slots_set_the_servers_slot_flags_and_nothing_without() -> None:
    def argv(routing: RoutingPolicy, scratch: str = "") -> list[str]:
        request = ShardRequest(
            model=ModelSpec(name="m", source="/w/m.gguf", routing=routing),
            node=NodeFacts(
                host="127.0.0.1", advertise_address="127.0.0.1", http_port=9000, scratch_dir=scratch
            ),
        )
        (command,) = LlamaCppPlanner().plan(request, KEY, {}).commands
        return list(command.argv)

    pinned = argv(RoutingPolicy(slots=6))
    flags = pinned_slot_flags(6)
    at = pinned.index(flags[0])
    assert pinned[at : at + len(flags)] == ["--parallel", "6", "--no-cache-idle-slots"]
    # Each slot its own cache of the model's whole context (512 by default).
    assert pinned[pinned.index("--ctx-size") + 1] == str(512 * 6)
    # No scratch dir, nowhere to save slots: no priming.
    assert "--slot-save-path" not in pinned
    plain = argv(RoutingPolicy(slots=0))
    assert not {"--parallel", "--no-cache-idle-slots"} & set(plain)
    assert plain[plain.index("--ctx-size") + 1] == "512"
    # With the shard's scratch dir, slots are saved in its own subdirectory
    # (the router primes a slot from another: router/forwarding/slot_priming.py).
    saving = argv(RoutingPolicy(slots=2), "/tmp/llmgw-x")
    assert saving[saving.index("--slot-save-path") + 1] == f"/tmp/llmgw-x/{SLOTS_SUBDIR}"
    assert "--slot-save-path" not in argv(RoutingPolicy(slots=0), "/tmp/llmgw-x")


def test_slots_are_part_of_how_the_engine_runs_the_rest_of_routing_is_not() -> None:
    base = ModelSpec(name="m", source="/w/m.gguf", routing={"slots": 0})
    assert base.model_copy(update={"routing": RoutingPolicy(balance_slack=5)}).digest() == (
        base.digest()
    )
    assert base.model_copy(update={"routing": RoutingPolicy(slots=4)}).digest() != base.digest()


def test_an_entry_without_slots_gets_four_within_the_kv_bound() -> None:
    """llama.cpp entries that leave slots out get AUTO_SLOTS pinned slots
    (bench_llamacpp_cache: 0.83 of a perfect cache against the engine's own
    0.77, and no request failed for a shared cache outgrown), unless four
    contexts pass the KV bound, the entry sizes slots or cache itself, or it
    says 0; the value is filled in, so what is stored says it."""

    def slots(**fields: object) -> int:
        return ModelSpec.model_validate(
            {"name": "m", "source": "/w/m.gguf", **fields}
        ).routing.slots

    assert slots() == AUTO_SLOTS == 4
    assert slots(routing={"balance_slack": 5}) == 4
    assert slots(routing=RoutingPolicy(balance_slack=5)) == 4
    assert slots(context_length=AUTO_SLOTS_KV_TOKENS // AUTO_SLOTS) == 4
    assert slots(context_length=AUTO_SLOTS_KV_TOKENS // AUTO_SLOTS + 1) == 0
    assert slots(routing={"slots": 0}) == 0
    assert slots(routing=RoutingPolicy(slots=0)) == 0
    assert slots(routing={"slots": 8}) == 8
    assert slots(engine_args=["-c", "8192"]) == 0
    assert slots(engine_args=["--parallel=2"]) == 0
    assert slots(profile={"engine_args": ["-np", "2"]}) == 0
    assert slots(engine="vllm") == 0
    stored = ModelSpec.model_validate({"name": "m", "source": "/w/m.gguf"})
    again = ModelSpec.model_validate_json(stored.model_dump_json())
    assert again.routing.slots == 4 and again.digest() == stored.digest()


def test_the_slots_default_leaves_bad_engine_args_to_their_field() -> None:
    """The default is filled in before validation: an ``engine_args`` that is
    not a list (schemathesis sent a float in CI, a 500) is refused by the
    field's own validation, naming it, not a TypeError in the default."""
    for fields in (
        {"engine_args": 1.5},
        {"profile": {"engine_args": 1.7976931348623157e308}},
        {"profile": {"engine_args": {"-np": 2}}},
    ):
        try:
            ModelSpec.model_validate({"name": "m", "source": "/w/m.gguf", **fields})
        except ValidationError as exc:
            assert "engine_args" in str(exc)
        else:
            raise AssertionError(f"{fields} was taken")


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


@contextlib.asynccontextmanager
async def _engine(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path, slots: int, scratch: str = ""
) -> AsyncIterator[tuple[httpx.AsyncClient, Child]]:
    """The engine plan's llama-server for ``slots`` pinned slots, ready, and its process."""
    install = llama_path.install
    port = free_port()
    request = ShardRequest(
        model=ModelSpec(
            name="tiny",
            source=str(tiny.model_path),
            context_length=4096,
            routing=RoutingPolicy(slots=slots),
        ),
        node=NodeFacts(
            host="127.0.0.1",
            advertise_address="127.0.0.1",
            http_port=port,
            threads=1,
            scratch_dir=scratch,
        ),
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
            assert len((await http.get("/slots")).json()) == slots
            yield http, engine
    finally:
        engine.stop(grace_s=5)


async def test_pinned_conversations_sharing_a_system_prompt_keep_their_histories(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    async with _engine(llama_path, tiny, tmp_path, slots=3) as (http, _):
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


async def test_a_slot_primed_from_another_finds_the_shared_system_prompt(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    # The agent's scratch dir and its slots subdirectory (the supervisor makes them).
    scratch = tmp_path / "scratch"
    (scratch / SLOTS_SUBDIR).mkdir(parents=True)
    async with _engine(llama_path, tiny, tmp_path, slots=3, scratch=str(scratch)) as (http, _):
        first = [{"role": "system", "content": SYSTEM}]
        (head_and_question, _) = await _turn(http, first, 0, "Conversation 0: what is rule 1?")
        upstream = AiohttpUpstream(5, 30, 4)
        try:
            primer = SlotPrimer(upstream, timeout_s=30)
            headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            assert await primer.prime("r1", str(http.base_url).rstrip("/"), headers, 0, 1)
            # Refused (here: without the engine key): not primed, no error raised.
            # (Slot ids are the router's own, never past the slots it set: this
            # build restores into a slot id past them and answers 200.)
            wrong = {"Authorization": "Bearer nope", "Content-Type": "application/json"}
            assert not await primer.prime("r1", str(http.base_url).rstrip("/"), wrong, 0, 1)
        finally:
            await upstream.aclose()
        assert [p.name for p in (scratch / SLOTS_SUBDIR).iterdir()] == [PRIME_FILE]
        primed = [{"role": "system", "content": SYSTEM}]
        cold = [{"role": "system", "content": SYSTEM}]
        prompt, cached = await _turn(http, primed, 1, "Conversation 1: and rule 2?")
        _, cold_cached = await _turn(http, cold, 2, "Conversation 2: and rule 3?")
        # The primed slot held conversation 0's prompt: its system prompt (all
        # but the question) came from the cache; the unprimed slot had nothing.
        assert cold_cached == 0
        assert prompt * 9 // 10 <= cached < head_and_question, (prompt, cached)


class _Counting:
    """An Upstream that counts what it sends."""

    def __init__(self, inner: AiohttpUpstream) -> None:
        self.inner = inner
        self.posts: list[str] = []

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        self.posts.append(url)
        return await self.inner.post(url, body, headers)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_an_engine_that_cannot_save_slots_is_not_asked_again(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    # No scratch dir: the plan gives no --slot-save-path; the engine answers
    # a slot action 501, and the primer leaves that replica alone for a while.
    async with _engine(llama_path, tiny, tmp_path, slots=2) as (http, _):
        upstream = _Counting(AiohttpUpstream(5, 30, 4))
        try:
            primer = SlotPrimer(upstream, timeout_s=30)
            headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            base = str(http.base_url).rstrip("/")
            assert not await primer.prime("r1", base, headers, 0, 1)
            assert not await primer.prime("r1", base, headers, 0, 1)
        finally:
            await upstream.aclose()
        assert upstream.posts == [f"{base}/slots/0?action=save"]


async def test_a_frozen_engine_leaves_its_requests_unprimed_not_waiting(
    llama_path: LlamaPath, tiny: TinyModel, tmp_path: Path
) -> None:
    # The engine SIGSTOPped between a conversation's turn and the next
    # one's priming: the copy gives up at its bound (the request then goes
    # unprimed), and once the engine runs again a copy works.
    scratch = tmp_path / "scratch"
    (scratch / SLOTS_SUBDIR).mkdir(parents=True)
    async with _engine(llama_path, tiny, tmp_path, slots=3, scratch=str(scratch)) as (
        http,
        engine,
    ):
        await _turn(http, [{"role": "system", "content": SYSTEM}], 0, "Conversation 0: rule 1?")
        upstream = AiohttpUpstream(5, 30, 4)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        base = str(http.base_url).rstrip("/")
        try:
            primer = SlotPrimer(upstream, timeout_s=0.5)
            engine.signal(signal.SIGSTOP)
            try:
                async with asyncio.timeout(30):  # the bound, not the engine, ends it
                    assert not await primer.prime("r1", base, headers, 0, 1)
            finally:
                engine.signal(signal.SIGCONT)
            patient = SlotPrimer(upstream, timeout_s=30)
            assert await patient.prime("r1", base, headers, 0, 1)
        finally:
            await upstream.aclose()
        talk = [{"role": "system", "content": SYSTEM}]
        prompt, cached = await _turn(http, talk, 1, "Conversation 1: and rule 2?")
        assert cached > prompt // 2, (prompt, cached)
