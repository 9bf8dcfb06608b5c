"""The routing rule (router/affinity/policy.py) and rendezvous hashing."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.types import RoutingPolicy, RoutingPolicyKind
from router.affinity.chunks import Chunk, PromptKey
from router.affinity.index import PrefixIndex
from router.affinity.policy import Choice, Reason, choose, rendezvous
from router.control_link.routing import Route

PREFIX = RoutingPolicy()


def _routes(*inflight: int) -> list[Route]:
    """Replicas r0.. with these loads, least loaded first (as the table gives them)."""
    made = [Route(f"r{i}", "m", f"http://h{i}:1", inflight=n) for i, n in enumerate(inflight)]
    return sorted(made, key=lambda r: r.inflight)


def _key(
    lead: int, *chunks: tuple[int, int], sticky: str | None = None, head: int = 0
) -> PromptKey:
    made = tuple(Chunk(d, t) for d, t in chunks)
    return PromptKey(made, lead, sticky, sum(c.tokens for c in made), head)


def _ids(choice: Choice) -> list[str]:
    return [r.replica_id for r in choice.order]


def _check_complete(choice: Choice, routes: list[Route]) -> None:
    """Every candidate once, nothing else: the proxy fails over down the list."""
    assert sorted(_ids(choice)) == sorted(r.replica_id for r in routes)
    assert all(any(r is c for c in routes) for r in choice.order)


def test_least_loaded_and_no_key_keep_the_candidates_order() -> None:
    routes = _routes(0, 1, 2)
    index = PrefixIndex(10_000)
    key = _key(5, (1, 500))
    index.record("r2", key)
    least = RoutingPolicy(policy=RoutingPolicyKind.LEAST_LOADED)
    for policy, k in ((least, key), (PREFIX, None)):
        choice = choose(policy, routes, k, index, None, 0)
        assert _ids(choice) == ["r0", "r1", "r2"]
        assert choice.reason is Reason.LEAST_LOADED and choice.predicted == 0
    assert choose(PREFIX, [], key, index, None, 0).order == []


def test_round_robin_rotates_by_turn() -> None:
    routes = _routes(0, 0, 0)
    rr = RoutingPolicy(policy=RoutingPolicyKind.ROUND_ROBIN)
    firsts = [choose(rr, routes, _key(1, (1, 9)), PrefixIndex(100), None, t) for t in range(6)]
    assert [_ids(c)[0] for c in firsts] == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert all(c.reason is Reason.ROUND_ROBIN for c in firsts)
    for choice in firsts:
        _check_complete(choice, routes)


def test_round_robin_covers_candidates_the_table_already_rotated() -> None:
    # RoutingTable.candidates turns its list by a counter of its own that
    # moves in step with the policy's turn: every replica must still get a turn.
    routes = _routes(0, 0, 0, 0)
    rr = RoutingPolicy(policy=RoutingPolicyKind.ROUND_ROBIN)
    firsts = []
    for t in range(8):
        rotated = routes[t % 4 :] + routes[: t % 4]
        firsts.append(_ids(choose(rr, rotated, _key(1, (1, 9)), PrefixIndex(100), None, t))[0])
    assert sorted(firsts) == ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"]


def test_session_is_rendezvous_of_the_lead_within_the_slack() -> None:
    routes = _routes(0, 0, 0, 0)
    session = RoutingPolicy(policy=RoutingPolicyKind.SESSION)
    key = _key(42, (1, 9))
    choice = choose(session, routes, key, PrefixIndex(100), None, 0)
    assert choice.reason is Reason.SESSION
    assert _ids(choice)[0] == rendezvous(42, ["r0", "r1", "r2", "r3"])[0]
    favourite = _ids(choice)[0]
    loaded = [Route(r.replica_id, "m", r.endpoint, inflight=9 if r.replica_id == favourite else 0)
              for r in routes]  # fmt: skip
    loaded.sort(key=lambda r: r.inflight)
    assert _ids(choose(session, loaded, key, PrefixIndex(100), None, 0))[0] != favourite


def test_prefix_follows_the_replica_holding_the_conversation() -> None:
    routes = _routes(0, 1, 2, 0)
    index = PrefixIndex(10_000)
    system = (1, 1000)
    for r in ("r0", "r1", "r2", "r3"):
        index.record(r, _key(0, system))  # every replica holds the system prompt
    conversation = _key(7, system, (2, 300), (3, 40))
    held_by = next(r for r in rendezvous(7, ["r0", "r1", "r2", "r3"]) if r != "r2")
    index.record("r2", _key(7, system, (2, 300)))
    choice = choose(PREFIX, routes, conversation, index, None, 0)
    assert _ids(choice)[0] == "r2" and choice.reason is Reason.PREFIX
    assert choice.predicted == 1300
    _check_complete(choice, routes)
    # Held by its own (rendezvous) replica too: that one, whatever the others hold.
    index.record(held_by, _key(7, system, (2, 300)))
    assert _ids(choose(PREFIX, routes, conversation, index, None, 0))[0] == held_by


def test_a_prefix_held_everywhere_pulls_nowhere() -> None:
    index = PrefixIndex(10_000)
    ids = ["r0", "r1", "r2", "r3"]
    for r in ids:
        index.record(r, _key(0, (1, 1000)))
    for lead in range(20):
        choice = choose(PREFIX, _routes(0, 0, 0, 0), _key(lead, (1, 1000), (9, 50)), index, None, 0)
        assert _ids(choice)[0] == rendezvous(lead, ids)[0]
        assert choice.reason is Reason.PREFIX and choice.predicted == 1000


def test_a_system_prompt_held_by_one_replica_does_not_pull_new_conversations() -> None:
    """Cold start: the first replica to serve the system prompt holds it
    alone; new conversations still go where their lead hashes (it is the
    prompt's head, which every replica holds once it served it)."""
    ids = ["r0", "r1", "r2", "r3"]
    index = PrefixIndex(10_000)
    index.record("r0", _key(0, (1, 1000), (5, 50), head=1000))
    moved = 0
    for lead in range(40):
        key = _key(lead, (1, 1000), (100 + lead, 50), head=1000)
        choice = choose(PREFIX, _routes(0, 0, 0, 0), key, index, None, 0)
        assert _ids(choice)[0] == rendezvous(lead, ids)[0]
        headless = _key(lead, (1, 1000), (100 + lead, 50), head=0)
        moved += _ids(choose(PREFIX, _routes(0, 0, 0, 0), headless, index, None, 0))[0] == "r0"
    assert moved == 40  # without the head credit every one would pile onto r0


def test_balance_when_the_best_cached_replica_is_too_loaded() -> None:
    index = PrefixIndex(10_000)
    conversation = _key(7, (1, 1000), (2, 300))
    index.record("r2", conversation)
    routes = _routes(0, 1, 3)  # r2 is 3 above the least loaded: past the slack of 2
    choice = choose(PREFIX, routes, conversation, index, None, 0)
    assert _ids(choice)[0] != "r2" and choice.reason is Reason.BALANCE
    assert choice.predicted == 0
    _check_complete(choice, routes)
    wider = RoutingPolicy(balance_slack=3)
    assert _ids(choose(wider, routes, conversation, index, None, 0))[0] == "r2"


def test_a_short_gain_does_not_leave_the_conversations_replica() -> None:
    ids = ["r0", "r1", "r2"]
    lead = 11
    other = rendezvous(lead, ids)[1]  # not the conversation's own replica
    index = PrefixIndex(10_000)
    # Long enough to pass the floor (min_match_tokens): only the gain is short.
    key = _key(lead, (1, 20), (2, 20), (3, 100))
    index.record(other, _key(lead, (1, 20)))
    routes = _routes(0, 0, 0)
    choice = choose(RoutingPolicy(min_match_tokens=64), routes, key, index, None, 0)
    assert choice.reason is Reason.RENDEZVOUS
    assert _ids(choice)[0] == rendezvous(lead, ids)[0]
    assert _ids(choose(RoutingPolicy(min_match_tokens=16), routes, key, index, None, 0))[0] == other


def test_a_prompt_shorter_than_min_match_tokens_goes_least_loaded() -> None:
    """Under prefix, a prompt whose whole cached prefix would be worth less
    than min_match_tokens is not followed: "hi" goes to every replica in
    turn, even where another replica holds it whole."""
    index = PrefixIndex(10_000)
    short = _key(5, (1, 10), (2, 20))  # 30 tokens < 64
    holder = next(r for r in rendezvous(5, ["r0", "r1", "r2"]) if r != "r0")
    index.record(holder, short)
    routes = _routes(0, 1, 1)
    choice = choose(PREFIX, routes, short, index, holder, 0, sticky_tokens=30)
    assert _ids(choice) == ["r0", "r1", "r2"]  # the candidates' own order
    assert choice.reason is Reason.LEAST_LOADED and choice.predicted == 0
    # As long as the floor, it is followed.
    floor = RoutingPolicy(min_match_tokens=30)
    choice = choose(floor, routes, short, index, None, 0)
    assert _ids(choice)[0] == holder and choice.reason is Reason.PREFIX
    assert choice.predicted == 30
    # The floor is prefix's: the other policies order a short prompt as ever.
    session = RoutingPolicy(policy=RoutingPolicyKind.SESSION)
    assert choose(session, routes, short, index, None, 0).reason is Reason.SESSION


def test_two_routers_serving_alternate_turns_agree() -> None:
    """Two routers, each with its own index, serve the turns of 40
    conversations in alternation: every turn of a conversation goes to one
    replica, the one rendezvous hashing of its lead names, whichever router
    saw the turns before."""
    ids = ["r0", "r1", "r2", "r3"]
    indexes = [PrefixIndex(1_000_000), PrefixIndex(1_000_000)]
    system = (1, 1000)
    for index in indexes:  # warm: each router has seen the system prompt served everywhere
        for r in ids:
            index.record(r, _key(0, system))
    served: dict[int, set[str]] = {}
    turn = 0
    for rounds in range(1, 4):
        for conversation in range(40):
            history = [(10_000 * conversation + i, 50) for i in range(rounds)]
            key = _key(1000 + conversation, system, *history)
            index = indexes[turn % 2]
            turn += 1
            choice = choose(PREFIX, _routes(0, 0, 0, 0), key, index, None, 0)
            assert choice.reason is Reason.PREFIX
            served.setdefault(conversation, set()).add(_ids(choice)[0])
            index.record(_ids(choice)[0], key)
    for conversation, replicas in served.items():
        assert replicas == {rendezvous(1000 + conversation, ids)[0]}


def test_a_sticky_replica_scores_as_holding_its_previous_prompt() -> None:
    index = PrefixIndex(10_000)
    key = _key(3, (1, 100), (2, 450), sticky="session:s")
    index.record("r0", _key(3, (1, 100)))
    routes = _routes(0, 0, 0)
    choice = choose(PREFIX, routes, key, index, "r2", 0, sticky_tokens=550)
    assert _ids(choice)[0] == "r2" and choice.reason is Reason.STICKY
    assert choice.predicted == 550
    # Same scoring, not a pin: load passes it over (BALANCE)...
    choice = choose(PREFIX, _routes(0, 0, 5), key, index, "r2", 0, sticky_tokens=550)
    assert _ids(choice)[0] != "r2" and choice.reason is Reason.BALANCE
    # ...and a replica holding much more of the prompt wins.
    index.record("r0", key)
    assert _ids(choose(PREFIX, routes, key, index, "r2", 0, sticky_tokens=100))[0] == "r0"


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    held=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3)), max_size=10),
    kind=st.sampled_from(list(RoutingPolicyKind)),
    slack=st.integers(0, 3),
    lead=st.integers(0, 2**64 - 1),
    turn=st.integers(0, 100),
    sticky=st.sampled_from([None, "r0", "r3", "gone"]),
)
def test_the_order_is_always_exactly_the_candidates(
    loads: list[int], held: list[tuple[int, int]], kind: RoutingPolicyKind, slack: int,
    lead: int, turn: int, sticky: str | None,
) -> None:  # fmt: skip
    routes = _routes(*loads)
    index = PrefixIndex(10_000)
    chain = [(d, 100) for d in range(1, 4)]
    for replica, length in held:
        index.record(f"r{replica}", _key(lead, *chain[:length]))  # r4, r5 may be absent
    policy = RoutingPolicy(policy=kind, balance_slack=slack, min_match_tokens=0)
    choice = choose(policy, routes, _key(lead, *chain), index, sticky, turn, sticky_tokens=150)
    _check_complete(choice, routes)
    if kind in (RoutingPolicyKind.PREFIX, RoutingPolicyKind.SESSION):
        assert choice.order[0].inflight <= min(loads) + slack


@settings(max_examples=50, deadline=None)
@given(
    ids=st.lists(st.text("abcdef0123456789-", min_size=1, max_size=12), min_size=2, max_size=8,
                 unique=True),
    gone=st.integers(0, 7),
)  # fmt: skip
def test_removing_a_replica_moves_only_the_keys_it_had(ids: list[str], gone: int) -> None:
    removed = ids[gone % len(ids)]
    rest = [i for i in ids if i != removed]
    for lead in range(300):
        before = rendezvous(lead * 0x9E3779B97F4A7C15 % 2**64, ids)
        after = rendezvous(lead * 0x9E3779B97F4A7C15 % 2**64, rest)
        if before[0] != removed:
            assert after[0] == before[0]
        assert after == [i for i in before if i != removed]  # the whole order too


def test_rendezvous_spreads_keys_roughly_evenly() -> None:
    ids = [f"replica-{i}" for i in range(4)]
    counts = Counter(rendezvous(lead * 0x9E3779B97F4A7C15 % 2**64, ids)[0] for lead in range(8000))
    assert set(counts) == set(ids)
    assert max(counts.values()) / min(counts.values()) < 1.15  # 2000 each, a few % apart
    assert rendezvous(5, ids) == rendezvous(5, list(reversed(ids)))  # order of input irrelevant
