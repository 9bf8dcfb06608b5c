"""The prefix index (router/affinity/index.py): LRU by capacity, the longest
leading run, self-correction, forgetting."""

from router.affinity.chunks import Chunk, PromptKey
from router.affinity.index import MIN_CAPACITY_SHARE, PrefixIndex


def _key(*chunks: tuple[int, int]) -> PromptKey:
    """A key of (digest, tokens) chunks (digests stand for chained prefixes)."""
    made = tuple(Chunk(d, t) for d, t in chunks)
    return PromptKey(made, made[0].digest, None, sum(c.tokens for c in made))


def test_match_is_the_longest_leading_run_held() -> None:
    index = PrefixIndex(10_000)
    index.record("r1", _key((1, 100), (2, 50), (3, 30)))
    assert index.match("r1", _key((1, 100), (2, 50), (3, 30), (4, 20))) == 180
    assert index.match("r1", _key((1, 100), (9, 50), (3, 30))) == 100  # stops at the first miss
    assert index.match("r1", _key((9, 100), (2, 50))) == 0  # nothing leading
    assert index.match("r2", _key((1, 100))) == 0
    assert index.held_tokens("r1") == 180 and index.held_tokens("r2") == 0
    assert index.replicas() == {"r1"}


def test_shared_prefixes_are_held_once() -> None:
    index = PrefixIndex(10_000)
    index.record("r1", _key((1, 1000), (2, 10)))
    index.record("r1", _key((1, 1000), (3, 10)))
    assert index.held_tokens("r1") == 1020


def test_capacity_evicts_the_least_recently_served_chains_from_their_tails() -> None:
    index = PrefixIndex(300)
    old = _key((1, 100), (2, 50))
    index.record("r1", old)
    index.record("r1", _key((3, 100)))
    index.record("r1", old)  # touched again: now the most recent
    index.record("r1", _key((4, 100)))  # 350 > 300: the oldest entry goes
    assert index.held_tokens("r1") <= 300
    assert index.match("r1", _key((3, 100))) == 0  # least recently served
    assert index.match("r1", old) == 150
    index.record("r1", _key((5, 100)))
    # Within one chain the tail goes before the head (an engine's prefix cache
    # cannot hold a chunk without what precedes it).
    assert index.match("r1", old) == 100
    assert index.held_tokens("r1") <= 300


def test_a_prompt_longer_than_the_capacity_keeps_its_head() -> None:
    index = PrefixIndex(250)
    index.record("r1", _key((1, 100), (2, 100), (3, 100)))
    assert index.match("r1", _key((1, 100), (2, 100), (3, 100))) == 200


def test_correct_trims_the_chain_past_what_the_engine_reported_and_shrinks() -> None:
    index = PrefixIndex(1000)
    other = _key((7, 300))
    chain = _key((1, 200), (2, 200), (3, 200))
    index.record("r1", other)
    index.record("r1", chain)
    assert index.match("r1", chain) == 600 and index.held_tokens("r1") == 900
    index.correct("r1", chain, predicted=600, reported=250)
    # Kept: the chunks ending within what was reported; dropped: the rest of the chain.
    assert index.match("r1", chain) == 200
    # The capacity estimate shrank by a quarter: 750, and the oldest chain is
    # evicted to fit (200 + 300 = 500 fits; nothing else was evicted).
    assert index.capacity("r1") == 750
    assert index.held_tokens("r1") == 500
    index.record("r1", _key((8, 300)))  # 800 > 750: the oldest (chain 7) goes
    assert index.match("r1", other) == 0


def test_the_capacity_estimate_has_a_floor_and_recovers_on_confirmed_predictions() -> None:
    index = PrefixIndex(800)
    chain = _key((1, 50), (2, 50))
    index.record("r1", chain)
    for _ in range(20):
        index.correct("r1", chain, predicted=100, reported=0)
        index.record("r1", chain)
    assert index.capacity("r1") == 800 // MIN_CAPACITY_SHARE
    index.correct("r1", chain, predicted=100, reported=100)
    assert index.capacity("r1") == 200
    for _ in range(20):
        index.correct("r1", chain, predicted=100, reported=120)
    assert index.capacity("r1") == 800  # never past the nominal
    index.correct("r1", chain, predicted=0, reported=0)  # nothing predicted: nothing learned
    assert index.capacity("r1") == 800


def test_forget_drops_one_replica_only() -> None:
    index = PrefixIndex(1000)
    key = _key((1, 100))
    index.record("r1", key)
    index.record("r2", key)
    index.forget("r1")
    index.forget("never-seen")
    assert index.match("r1", key) == 0 and index.held_tokens("r1") == 0
    assert index.match("r2", key) == 100
    assert index.replicas() == {"r2"}


def test_a_new_nominal_capacity_applies_at_once() -> None:
    index = PrefixIndex(1000)
    index.record("r1", _key((1, 400), (2, 400)))
    index.set_capacity(500)
    assert index.held_tokens("r1") <= 500 and index.capacity("r1") == 500
