"""llama.cpp slot pinning wired into the router (catalog ``routing.slots``):
each conversation's requests carry its own ``id_slot``, appended last so a
client's own never wins; a slot is held until its request (streamed or not)
ends; the slot is on the span; other engines and models without slots get
no ``id_slot``; a slot whose request waited long and ended unanswered is
left out for a while. The slot table's rule: tests/gateway/test_affinity_slots.py;
real llama.cpp behind the router: tests/e2e/test_slot_pinning.py."""

import asyncio
import json
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw.types import EngineKind, ModelSpec, RoutingPolicy, RoutingPolicyKind
from router.affinity.affinity import Affinity
from router.affinity.slots import BLOCK_S, STUCK_S, with_slot
from tests.gateway.test_prefix_routing import (
    REPLICAS,
    CachingEngine,
    M,
    ask,
    exporter,
    model,
    routed,
    turns,
)
from tests.gateway_util import ADMIN_KEY, Gateway, auth, gateway

__all__ = ["exporter"]  # the fixture, imported for these tests


def slots_model(slots: int = 3, policy: RoutingPolicyKind = RoutingPolicyKind.PREFIX) -> ModelSpec:
    return model().model_copy(update={"routing": RoutingPolicy(policy=policy, slots=slots)})


def sent_slot(content: bytes) -> int | None:
    value = json.loads(content).get("id_slot")
    return value if isinstance(value, int) else None


def test_with_slot_appends_the_field_last() -> None:
    assert json.loads(with_slot(b'{"a":1}', 2)) == {"a": 1, "id_slot": 2}
    assert with_slot(b"{}", 0) == b'{"id_slot":0}'
    assert with_slot(b'{"id_slot":7, "a":1}\n', 1).endswith(b'"id_slot":1}')
    assert with_slot(b"[1]", 1) == b"[1]"  # not an object: left alone


@pytest.mark.parametrize("stream", [False, True])
async def test_each_conversation_keeps_its_own_slot_and_the_routers_id_slot_wins(
    tmp_path: Path, exporter: InMemorySpanExporter, stream: bool
) -> None:
    async with routed(tmp_path, exporter, slots_model(), REPLICAS[:1]) as r:
        _, key = r.gw.key()
        slots: dict[str, list[int | None]] = {"a": [], "b": [], "c": []}
        for n in (1, 2, 3):
            for name, sent in slots.items():
                # A client asking for slot 0 itself is overruled: the router's
                # id_slot comes last, the value llama.cpp reads.
                await ask(r.gw, key, turns(name, n), stream, extra={"id_slot": 0})
                sent.append(sent_slot(r.engine.seen[-1].content))
        owned = [set(s) for s in slots.values()]
        assert all(len(s) == 1 and None not in s for s in owned), slots
        assert len(set.union(*owned)) == 3  # three conversations, three slots
        attrs = [dict(s.attributes or {}) for s in exporter.get_finished_spans()]
        assert [a["llmgw.route.slot"] for a in attrs] == [
            slots[name][n] for n in range(3) for name in slots
        ]
        # They share a system prompt of ~290 estimated tokens (prime_tokens:
        # 256): b's and c's first turns went to slots primed first from an
        # idle slot holding it (c's: a or b, prompts of one length); no turn after.
        a, b, c = (slots[name][0] for name in slots)
        actions = [(slot, action) for _, slot, action in r.engine.slot_actions]
        donor = actions[2][0]
        assert donor in (a, b)
        assert actions == [(a, "save"), (b, "restore"), (donor, "save"), (c, "restore")]
        assert [x.get("llmgw.route.primed_from") for x in attrs[:3]] == [None, a, donor]
        assert [x.get("llmgw.route.primed") for x in attrs[:3]] == [None, True, True]
        assert not any("llmgw.route.primed" in x for x in attrs[3:])


async def test_a_slot_is_held_until_its_request_ends(tmp_path: Path) -> None:
    """Two requests of one conversation at once get two slots; with every
    slot busy a third waits in the router's queue (never sent unpinned, to a
    slot the engine picks and the router may pin another request to while
    it is busy); once one ends it goes to the freed slot."""
    async with routed(tmp_path, None, slots_model(slots=2), REPLICAS[:1]) as r:
        _, key = r.gw.key()
        host = "e1"
        r.engine.holds[host] = asyncio.Event()
        first = asyncio.create_task(ask(r.gw, key, turns("a", 2), True))
        second = asyncio.create_task(ask(r.gw, key, turns("a", 2), False))
        async with asyncio.timeout(30):
            while len(r.engine.seen) < 2:
                await asyncio.sleep(0.01)
        held = {sent_slot(q.content) for q in r.engine.seen}
        assert held == {0, 1}
        # The client asks for slot 0 (busy): it waits for a slot of the router's
        # choosing, and its own id_slot never reaches the engine.
        third = asyncio.create_task(ask(r.gw, key, turns("b", 1), False, extra={"id_slot": 0}))
        admission = r.gw.app.state.deps.admission
        async with asyncio.timeout(30):
            while admission.waiting(M) < 1:
                await asyncio.sleep(0.01)
        assert len(r.engine.seen) == 2
        r.engine.holds[host].set()
        await asyncio.gather(first, second, third)
        assert len(r.engine.seen) == 3
        assert sent_slot(r.engine.seen[2].content) in (0, 1)
        await ask(r.gw, key, turns("b", 2), False)
        assert sent_slot(r.engine.seen[-1].content) in (0, 1)


@pytest.mark.parametrize(
    "routing",
    [
        RoutingPolicy(),  # slots off
        RoutingPolicy(policy=RoutingPolicyKind.LEAST_LOADED),
    ],
)
async def test_no_id_slot_without_slots(tmp_path: Path, routing: RoutingPolicy) -> None:
    spec = model().model_copy(update={"routing": routing})
    async with routed(tmp_path, None, spec) as r:
        _, key = r.gw.key()
        await ask(r.gw, key, turns("a", 1))
        assert "id_slot" not in json.loads(r.engine.seen[-1].content)


async def test_least_loaded_pins_too_and_other_engines_never(tmp_path: Path) -> None:
    async with routed(tmp_path, None, slots_model(policy=RoutingPolicyKind.LEAST_LOADED)) as r:
        _, key = r.gw.key()
        await ask(r.gw, key, turns("a", 1))
        assert sent_slot(r.engine.seen[-1].content) is not None
    vllm = slots_model().model_copy(update={"engine": EngineKind.VLLM})
    (tmp_path / "v").mkdir()
    async with routed(tmp_path / "v", None, vllm) as r:
        _, key = r.gw.key()
        await ask(r.gw, key, turns("a", 1))
        assert "id_slot" not in json.loads(r.engine.seen[-1].content)


async def test_the_admin_view_shows_what_this_router_believes_each_replica_holds(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path, None, slots_model(), REPLICAS[:2]) as r:
        _, key = r.gw.key()
        served = (await ask(r.gw, key, turns("a", 2))).headers["x-llmgw-replica"]
        await ask(r.gw, key, turns("b", 1))
        views = (await r.gw.http.get("/admin/replicas", headers=auth(ADMIN_KEY))).json()
        by_id = {v["replica_id"]: v for v in views}
        assert by_id[served]["held_tokens"] > 0 and by_id[served]["pinned_slots"] >= 1
        assert sum(v["pinned_slots"] for v in views) == 2  # two conversations
        r.affinity.forget(served)
        views = (await r.gw.http.get("/admin/replicas", headers=auth(ADMIN_KEY))).json()
        gone = next(v for v in views if v["replica_id"] == served)
        assert gone["held_tokens"] == 0 and gone["pinned_slots"] == 0


class Clock:
    """The affinity's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_slots(
    tmp_path: Path, clock: Clock, engine: CachingEngine
) -> "AbstractAsyncContextManager[Gateway]":
    """A router on one replica of a model with two pinned slots, its
    affinity on ``clock``."""
    return gateway(
        tmp_path / "s.db", REPLICAS[:1], [slots_model(slots=2)], engine,
        affinity=Affinity(clock=clock),
    )  # fmt: skip


async def _seen(engine: CachingEngine, n: int) -> None:
    async with asyncio.timeout(30):
        while len(engine.seen) < n:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_slot_whose_request_waited_unanswered_is_left_out_for_a_while(
    tmp_path: Path, stream: bool
) -> None:
    """The slot a conversation is pinned to answers nothing (held by a
    request this router does not know); its request waits there past
    STUCK_S and its client gives up. Its next request goes to another slot
    instead of queueing behind the same one again, until BLOCK_S has passed."""
    clock, engine = Clock(), CachingEngine()
    async with two_slots(tmp_path, clock, engine) as gw:
        _, key = gw.key()
        await ask(gw, key, turns("a", 1), stream)
        stuck = sent_slot(engine.seen[-1].content)
        engine.holds["e1"] = asyncio.Event()  # the engine sends nothing now
        waiting = asyncio.create_task(ask(gw, key, turns("a", 2), stream))
        await _seen(engine, 2)
        assert sent_slot(engine.seen[-1].content) == stuck
        clock.now += STUCK_S
        waiting.cancel()  # the client gives up
        await asyncio.gather(waiting, return_exceptions=True)
        del engine.holds["e1"]
        await ask(gw, key, turns("a", 2), stream)
        moved = sent_slot(engine.seen[-1].content)
        assert moved not in (None, stuck)
        await ask(gw, key, turns("a", 3), stream)
        assert sent_slot(engine.seen[-1].content) == moved  # its slot now
        clock.now += BLOCK_S
        await ask(gw, key, turns("b", 1), stream)
        assert sent_slot(engine.seen[-1].content) == stuck  # back in the choices


@pytest.mark.parametrize("stream", [False, True])
async def test_a_long_wait_that_ends_in_an_answer_keeps_the_slot(
    tmp_path: Path, stream: bool
) -> None:
    clock, engine = Clock(), CachingEngine()
    async with two_slots(tmp_path, clock, engine) as gw:
        _, key = gw.key()
        await ask(gw, key, turns("a", 1))
        slot = sent_slot(engine.seen[-1].content)
        engine.holds["e1"] = asyncio.Event()
        slow = asyncio.create_task(ask(gw, key, turns("a", 2), stream))
        await _seen(engine, 2)
        clock.now += 10 * STUCK_S  # a long prefill, or a wait behind another router's turn
        engine.holds["e1"].set()
        await slow
        await ask(gw, key, turns("a", 3))
        assert sent_slot(engine.seen[-1].content) == slot


async def test_a_pinned_stream_without_a_first_byte_is_sent_again_elsewhere(
    tmp_path: Path,
) -> None:
    """The conversation's slot answers nothing (a task the engine never
    finishes: seen with two routers). Past slot_stuck_s without a first
    byte, the router cancels the stream and sends it once more on the same
    replica, to another slot; the client gets its answer, and the slot is
    left out of the next choices. A non-streamed request is not cut: its
    headers come only with the whole answer."""
    engine = StuckSlotEngine()
    async with gateway(
        tmp_path / "s.db", REPLICAS[:1], [slots_model(slots=2)], engine, slot_stuck_s=0.3,
    ) as gw:  # fmt: skip
        _, key = gw.key()
        await ask(gw, key, turns("a", 1), True)
        stuck = sent_slot(engine.seen[-1].content)
        assert stuck is not None
        engine.stuck = stuck  # from now on that slot never answers
        await ask(gw, key, turns("a", 2), True)  # answered, from the other slot
        tried = [sent_slot(q.content) for q in engine.seen[1:]]
        assert tried == [stuck, 1 - stuck], tried
        await ask(gw, key, turns("a", 3), True)
        assert sent_slot(engine.seen[-1].content) == 1 - stuck  # the stuck one left out
        metrics = (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text
        assert 'kind="slot_stuck"' in metrics


@dataclass
class StuckSlotEngine(CachingEngine):
    """A CachingEngine whose slot ``stuck`` never answers (None: all do)."""

    stuck: int | None = None

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.stuck is not None and sent_slot(request.content) == self.stuck:
            self.seen.append(request)
            await asyncio.Event().wait()  # until the router cancels it
        return await super().handle(request)


async def test_a_prompt_the_router_cannot_key_is_pinned_too(tmp_path: Path) -> None:
    """A prompt of token ids has no prompt key, yet it takes a slot of the
    router's choosing: sent with id_slot -1 it would take one the router may
    then pin a conversation's request to while it is busy."""
    async with routed(tmp_path, None, slots_model(slots=2), REPLICAS[:1]) as r:
        _, key = r.gw.key()
        body = {"model": M, "prompt": [1, 2, 3], "max_tokens": 2}
        sent = await r.gw.http.post("/v1/completions", json=body, headers=auth(key))
        assert sent.status_code == 200, sent.text
        assert sent_slot(r.engine.seen[-1].content) in (0, 1)
