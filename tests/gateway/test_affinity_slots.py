"""llama.cpp slot pinning (router/affinity/slots.py), pure: a conversation
keeps its slot, a new one takes a free slot or the least recently used idle
one, a busy slot is never given to another request, a slot whose request
waited long and ended unanswered is left out for a while, and the catalog
refuses slots it cannot honour."""

import logging

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from llmgw.catalog import CatalogModel, catalog_problems
from llmgw.settings import RouterSettings
from llmgw.types import EngineKind, EngineProfile, ModelSpec, RoutingPolicy
from router.affinity.affinity import Affinity, capacity_tokens
from router.affinity.chunks import Chunk, PromptKey
from router.affinity.slots import BLOCK_S, STUCK_S, Slots, SlotShare, SlotTable


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_conversation_returns_to_its_own_slot_while_others_come_and_go() -> None:
    table = SlotTable(4)
    mine = table.pin(101)
    assert mine is not None
    table.release(mine, answered=True)
    others = []
    for conversation in (202, 303, 404):
        slot = table.pin(conversation)
        assert slot is not None
        others.append(slot)
        table.release(slot, answered=True)
    assert mine not in others and len(set(others)) == 3  # free slots first
    assert table.pin(101) == mine


def test_with_no_free_slot_the_least_recently_used_idle_one_is_taken() -> None:
    table = SlotTable(2)
    first, second = table.pin(1), table.pin(2)
    assert first is not None and second is not None
    table.release(first, answered=True)
    table.release(second, answered=True)
    assert table.pin(2) == second  # 2 used again: 1's slot is now the oldest
    table.release(second, answered=True)
    assert table.pin(3) == first
    table.release(first, answered=True)
    assert table.owner(first) == 3
    # 1 lost its slot: it starts over like a new conversation (the oldest, 2's).
    assert table.pin(1) == second


def test_a_busy_slot_is_never_shared_and_a_full_table_pins_nothing() -> None:
    table = SlotTable(2)
    a = table.pin(1)
    again = table.pin(1)  # the same conversation twice at once (questions on one document)
    assert a is not None and again is not None and again != a
    assert table.pin(2) is None  # both busy: unpinned, the engine queues it
    table.release(a, answered=True)
    assert table.pin(2) == a


def test_new_conversations_spread_over_free_slots_by_their_own_hash() -> None:
    # Two routers that never talked, each with empty tables, put a new
    # conversation in the same free slot.
    for conversation in range(50):
        assert SlotTable(8).pin(conversation) == SlotTable(8).pin(conversation)
    assert len({SlotTable(8).pin(c) for c in range(50)}) > 4


def test_slots_per_replica_resize_and_forget() -> None:
    slots = Slots()
    assert slots.pin("r1", 0, 1) is None  # slots off
    first = slots.pin("r1", 4, 1)
    assert first is not None
    slots.release("r1", first, answered=True)
    assert slots.pin("r1", 4, 1) == first
    slots.release("r1", first, answered=True)
    slots.forget("r1")  # restarted: empty slots, any may be chosen again
    assert slots.pin("r1", 4, 2) is not None
    slots.release("r1", 99, answered=True)  # a slot of an older size: ignored
    assert slots.pin("r1", 2, 1) in (0, 1)  # resized with its engine


@given(
    st.integers(1, 4),
    st.integers(1, 12),
    st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 9)), max_size=120),
)
def test_routers_with_their_own_shares_never_pin_one_slot(
    routers: int, size: int, ops: list[tuple[int, bool, int]]
) -> None:
    # Each router pins only its share (s % routers == its index); together
    # they can use every slot, and no slot is ever held by two routers'
    # requests at once (llama.cpp would queue one behind the other).
    tables = [SlotTable(size, share=SlotShare(i, routers)) for i in range(routers)]
    held: dict[int, int] = {}  # slot -> the router whose request holds it
    for drawn, pin, conversation in ops:
        router = drawn % routers
        table = tables[router]
        if pin:
            slot = table.pin(conversation)
            mine = [s for s in range(size) if s % routers == router]
            if slot is None:
                assert all(held.get(s) == router for s in mine)  # its whole share busy
            else:
                assert slot in mine and slot not in held
                held[slot] = router
        else:
            slots = sorted(s for s, r in held.items() if r == router)
            if slots:
                slot = slots[conversation % len(slots)]
                table.release(slot, answered=True)
                del held[slot]


def test_a_share_beyond_the_replicas_slots_pins_nothing_and_primes_within_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slots = Slots(share=SlotShare(2, 3))
    with caplog.at_level(logging.WARNING):
        assert slots.pin("r1", 2, 1) is None  # slots 0 and 1 are routers 0's and 1's
    assert "none is this router's (slot share 2 of 3)" in caplog.text
    # Router 0 of 2 holds slots 0 and 2 of 4: a donor is one of its own.
    table = SlotTable(4, share=SlotShare(0, 2))
    first = table.pin(1)
    assert first is not None
    table.primer_for(first, head=7, tokens=1000)
    table.release(first, answered=True)
    second = table.pin(2)
    assert second is not None and {first, second} == {0, 2}
    assert table.primer_for(second, head=7, tokens=1100) == first


def test_a_pinned_models_inflight_cap_is_this_routers_share_of_its_slots() -> None:
    def cap(share: SlotShare, engine: EngineKind = EngineKind.LLAMA_CPP, **profile: int) -> int:
        spec = ModelSpec(
            name="m", source="/w", engine=engine, routing=RoutingPolicy(slots=8),
            profile=EngineProfile.model_validate(profile),
        )  # fmt: skip
        return Affinity(slot_share=share).inflight_cap(spec)

    assert cap(SlotShare()) == 8  # no max_inflight: the slots bound it
    assert cap(SlotShare(), max_inflight=4) == 4
    assert cap(SlotShare(1, 2)) == 4 and cap(SlotShare(2, 3), max_inflight=2) == 2
    assert cap(SlotShare(), EngineKind.VLLM) == 0  # slots are llama.cpp's: no cap
    assert cap(SlotShare(8, 9), max_inflight=3) == 3  # a share with no slot pins nothing


def test_the_router_settings_refuse_a_share_outside_the_shares() -> None:
    assert RouterSettings(slot_share=1, slot_shares=2).slot_shares == 2
    with pytest.raises(ValueError, match="needs 0 <= slot_share < slot_shares"):
        RouterSettings(slot_share=2, slot_shares=2)
    with pytest.raises(ValueError, match="needs 0 <= share < shares"):
        SlotShare(1, 1)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=80))
def test_busy_counts_never_exceed_what_was_pinned(ops: list[tuple[bool, int]]) -> None:
    table = SlotTable(3)
    held: list[int] = []
    for pin, conversation in ops:
        if pin:
            slot = table.pin(conversation)
            if slot is None:
                assert len(held) >= 3  # only when every slot is busy
            else:
                assert slot not in held  # never a busy slot
                held.append(slot)
        elif held:
            table.release(held.pop(conversation % len(held)), answered=True)


def test_the_catalog_refuses_slots_it_cannot_honour() -> None:
    def problems(**fields: object) -> list[str]:
        model = CatalogModel.model_validate({"name": "m", "source": "/w/m.gguf", **fields})
        return catalog_problems([model])

    assert problems(routing={"slots": 8}) == []
    vllm = problems(engine=EngineKind.VLLM.value, routing={"slots": 8})
    assert len(vllm) == 1 and "routing.slots" in vllm[0]
    clash = problems(routing={"slots": 8}, engine_args=["-np", "2", "--no-cache-idle-slots"])
    assert len(clash) == 2 and all("decided by routing.slots" in p for p in clash)
    assert problems(engine_args=["-np", "2"]) == []  # without slots the flag is the user's
    assert RoutingPolicy().slots == 0


def test_a_conversation_on_several_slots_goes_back_to_any_of_them() -> None:
    """Questions on one document sent together fill several slots; each of
    those slots holds the document, so the next question takes one of them
    rather than a slot of another conversation."""
    table = SlotTable(4)
    a, b = table.pin(1), table.pin(1)
    other = table.pin(2)
    assert a is not None and b is not None and other is not None
    for slot in (a, b, other):
        table.release(slot, answered=True)
    assert table.pin(1) == b  # the one used last
    assert table.pin(1) == a  # b busy: a, which holds it too
    assert table.pin(1) not in (a, b, other)  # both busy: a free one


def test_a_pinned_replicas_cache_is_a_context_per_slot() -> None:
    spec = ModelSpec(name="m", source="/m.gguf", context_length=1000, routing={"slots": 0})
    assert capacity_tokens(spec) == 1000
    pinned = spec.model_copy(update={"routing": RoutingPolicy(slots=4)})
    assert capacity_tokens(pinned) == 4000
    # A -c of the entry's own is the whole cache, whatever the slots.
    assert capacity_tokens(pinned.model_copy(update={"engine_args": ["-c", "9000"]})) == 9000


def test_a_slot_whose_request_waited_and_ended_unanswered_is_left_out_for_a_while() -> None:
    """The stall seen with two routers: a slot held by a request this router
    does not know (another router's, or one that never finishes); its own
    request pinned there waits, unanswered, until its client gives up. The
    conversation's next request goes to another slot, not behind it again."""
    clock = Clock()
    table = SlotTable(3, clock, stuck_s=STUCK_S, block_s=BLOCK_S)
    stuck = table.pin(1)
    assert stuck is not None
    clock.now += STUCK_S
    assert table.release(stuck, answered=False) == STUCK_S  # blocked: how long it waited
    moved = table.pin(1)
    assert moved not in (None, stuck)  # a free slot, as a new conversation's
    table.release(moved, answered=True)
    assert table.pin(1) == moved  # its slot now
    # Nobody else is given the stuck slot either: with it left out, the
    # other two busy, a request goes unpinned (the engine picks an idle slot).
    other = table.pin(2)
    assert other not in (None, stuck, moved)
    assert table.pin(3) is None
    # The block ends: the slot is chosen again.
    clock.now += BLOCK_S
    assert table.pin(3) == stuck


def test_a_short_wait_or_an_answer_leaves_the_slot_in() -> None:
    clock = Clock()
    table = SlotTable(2, clock)
    slot = table.pin(1)
    assert slot is not None
    clock.now += STUCK_S - 1  # its client gave up sooner: proves nothing
    assert table.release(slot, answered=False) == 0
    assert table.pin(1) == slot
    clock.now += 10 * STUCK_S  # a long wait that ended with an answer (a long prefill)
    assert table.release(slot, answered=True) == 0
    assert table.pin(1) == slot


def test_slots_pass_their_bounds_to_every_table_and_log_a_block(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    slots = Slots(clock, stuck_s=1.0, block_s=5.0)
    stuck = slots.pin("r1", 2, 1)
    assert stuck is not None
    clock.now += 1.0
    with caplog.at_level(logging.WARNING, logger="router.affinity.slots"):
        slots.release("r1", stuck, answered=False)
    assert any(f"slot {stuck} of replica r1" in r.getMessage() for r in caplog.records)
    assert slots.pin("r1", 2, 1) not in (None, stuck)
    clock.now += 5.0
    assert slots.pin("r1", 2, 9) == stuck
    slots.forget("r1")  # restarted: nothing left out
    assert slots.pin("r1", 2, 1) is not None and slots.pin("r1", 2, 2) is not None


@given(
    st.lists(
        st.tuples(st.sampled_from(["pin", "answered", "unanswered", "wait"]), st.integers(0, 6)),
        max_size=80,
    )
)
@example([("pin", 1), ("wait", 2), ("unanswered", 0), ("pin", 1)])  # the stall's loop
def test_a_pinned_slot_is_never_busy_nor_left_out(ops: list[tuple[str, int]]) -> None:
    """Whatever the order of pins, releases and waits: a request gets an idle
    slot not left out when there is one, else none; a slot is left out
    exactly when its request waited ``stuck_s`` and ended unanswered."""
    clock = Clock()
    table = SlotTable(3, clock, stuck_s=10.0, block_s=100.0)
    held: dict[int, float] = {}  # slot -> when it was pinned
    out: dict[int, float] = {}  # slot -> until when it is left out
    for op, n in ops:
        if op == "wait":
            clock.now += 5.0 * n
        elif op == "pin":
            slot = table.pin(n)
            open_ = [i for i in range(3) if i not in held and out.get(i, 0.0) <= clock.now]
            if slot is None:
                assert not open_
            else:
                assert slot in open_
                held[slot] = clock.now
        elif held:
            slot = list(held)[n % len(held)]
            waited = clock.now - held.pop(slot)
            left_out = table.release(slot, answered=op == "answered")
            expected = op == "unanswered" and waited >= 10.0
            assert (left_out > 0) == expected and (not expected or left_out == waited)
            if expected:
                out[slot] = clock.now + 100.0


def test_a_slot_is_primed_from_the_idle_one_holding_its_head_with_the_shortest_prompt() -> None:
    table = SlotTable(5)
    a = table.pin(1)
    assert a is not None and table.primer_for(a, 7, 3000) is None  # no slot holds it yet
    b = table.pin(2)
    assert b is not None and table.primer_for(b, 7, 1200) is None  # a is busy
    table.release(a, answered=True)
    table.release(b, answered=True)
    c = table.pin(3)
    # Both hold head 7: b's prompt is the shorter copy.
    assert c is not None and table.primer_for(c, 7, 1100) == b
    table.release(c, answered=True)
    again = table.pin(3)
    assert again == c and table.primer_for(c, 7, 1300) is None  # it holds the head now
    table.release(c, answered=True)
    d = table.pin(4)
    assert d is not None and table.primer_for(d, 8, 900) is None  # no slot holds that head


def test_a_slot_reused_without_a_head_is_known_not_to_hold_one() -> None:
    # Every pinned request tells the table what its slot now holds: a slot
    # whose last prompt had no head (or another) is primed again.
    table = SlotTable(2)
    a = table.pin(1)
    assert a is not None and table.primer_for(a, 7, 1000) is None
    table.release(a, answered=True)
    b = table.pin(2)
    assert b is not None and table.primer_for(b, 7, 1000) == a
    table.release(b, answered=True)
    reused = table.pin(3)  # the least recently used: a, now a prompt without a head
    assert reused == a and table.primer_for(a, None, 50) is None
    table.release(a, answered=True)
    back = table.pin(3)  # the same conversation, now with head 7 (a system prompt)
    assert back == a and table.primer_for(a, 7, 1100) == b


def test_the_affinity_primes_only_heads_of_prime_tokens_or_more() -> None:
    spec = ModelSpec(name="m", source="/m.gguf", routing=RoutingPolicy(slots=4, prime_tokens=300))
    affinity = Affinity()
    head = (Chunk(11, 256), Chunk(12, 100))  # the system prompt: two chunks, 356 tokens
    keys = [
        PromptKey((*head, Chunk(100 + n, 20)), 100 + n, None, 376, head_tokens=356)
        for n in range(3)
    ]
    first = affinity.pin(spec, "r1", keys[0])
    assert first is not None and affinity.primer(spec, "r1", first, keys[0]) is None
    affinity.release("r1", first, answered=True)
    second = affinity.pin(spec, "r1", keys[1])
    assert second is not None and affinity.primer(spec, "r1", second, keys[1]) == first
    short = spec.model_copy(update={"routing": RoutingPolicy(slots=4, prime_tokens=400)})
    off = spec.model_copy(update={"routing": RoutingPolicy(slots=4, prime_tokens=0)})
    third = affinity.pin(spec, "r1", keys[2])
    assert third is not None
    assert affinity.primer(short, "r1", third, keys[2]) is None  # a head under 400 tokens
    assert affinity.primer(off, "r1", third, keys[2]) is None
    assert affinity.primer(spec, "r1", third, None) is None


def test_the_affinity_records_every_pinned_prompts_head_primed_or_not() -> None:
    # Two slots: conversation 1 (head H) in one, 2 (head H) in the other;
    # then 3, without a system prompt, takes 1's slot. When 1 comes back to
    # that slot, it no longer holds H: primed from 2's.
    spec = ModelSpec(name="m", source="/m.gguf", routing=RoutingPolicy(slots=2, prime_tokens=64))
    head = (Chunk(11, 256),)

    def key(conversation: int, with_head: bool = True) -> PromptKey:
        chunks = (*head, Chunk(conversation, 20)) if with_head else (Chunk(conversation, 20),)
        tokens = sum(c.tokens for c in chunks)
        return PromptKey(chunks, conversation, None, tokens, 256 if with_head else 0)

    affinity = Affinity()
    slots = []
    for conversation in (1, 2):
        slot = affinity.pin(spec, "r1", key(conversation))
        assert slot is not None
        affinity.primer(spec, "r1", slot, key(conversation))
        affinity.release("r1", slot, answered=True)
        slots.append(slot)
    taken = affinity.pin(spec, "r1", key(3, with_head=False))
    assert taken == slots[0]  # the least recently used
    assert affinity.primer(spec, "r1", taken, key(3, with_head=False)) is None
    affinity.release("r1", taken, answered=True)
    # Conversation 3 again, now with the system prompt: its slot lost H.
    back = affinity.pin(spec, "r1", key(3))
    assert back == slots[0] and affinity.primer(spec, "r1", back, key(3)) == slots[1]
