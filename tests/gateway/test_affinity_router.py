"""The router's Affinity (router/affinity/affinity.py): what it records,
corrects and forgets, and two routers that never talk."""

from llmgw.types import EngineKind, EngineProfile, ModelSpec, RoutingPolicy, RoutingPolicyKind
from router.affinity.affinity import (
    FALLBACK_CAPACITY,
    POOL_CONTEXTS,
    STICKY_TTL_S,
    VLLM_BLOCK_CPU,
    VLLM_BLOCK_GPU,
    Affinity,
    cache_block_tokens,
    capacity_tokens,
)
from router.affinity.chunks import PromptKey, prompt_key
from router.affinity.policy import Choice, Reason, rendezvous
from router.control_link.routing import Route

IDS = ["r0", "r1", "r2", "r3"]
# ~1000 tokens of system prompt, shared by every conversation.
SYSTEM: dict[str, object] = {"role": "system", "content": "Answer in one word. " * 200}


def _spec(name: str = "m", context: int = 100_000, **routing: object) -> ModelSpec:
    # The engine's own slots unless a test pins some: the index's bound is
    # then the context itself (pinned slots multiply it).
    return ModelSpec(
        name=name, source="/w.gguf", context_length=context,
        routing=RoutingPolicy.model_validate({"slots": 0, **routing}),
    )  # fmt: skip


def _routes(model: str = "m", ids: list[str] = IDS) -> list[Route]:
    return [Route(r, model, f"http://{r}:1") for r in ids]


def _turns(conversation: int, rounds: int, sticky: str | None = None) -> PromptKey:
    messages: list[dict[str, object]] = [SYSTEM]
    for r in range(rounds):
        messages.append({"role": "user", "content": f"conversation {conversation} q{r} " * 30})
        if r < rounds - 1:
            messages.append({"role": "assistant", "content": f"answer {r}"})
    key = prompt_key({"messages": messages}, 256, sticky)
    assert key is not None
    return key


def _serve(
    affinity: Affinity, spec: ModelSpec, key: PromptKey, cached: int | None = None
) -> Choice:
    choice = affinity.choose(spec, _routes(spec.name), key)
    affinity.served(spec.name, choice.order[0].replica_id, key, choice, key.prompt_tokens, cached)
    return choice


def test_a_follow_up_turn_goes_where_the_history_was_served() -> None:
    affinity, spec = Affinity(), _spec()
    first = _turns(1, 1)
    elsewhere = rendezvous(first.lead, IDS)[1]  # not where its hash would put it
    affinity.served("m", elsewhere, first, Choice([], Reason.BALANCE, 0), None, None)
    assert affinity.held_tokens("m", elsewhere) == first.prompt_tokens
    choice = affinity.choose(spec, _routes(), _turns(1, 2))
    assert choice.order[0].replica_id == elsewhere
    assert choice.reason is Reason.PREFIX and choice.predicted == first.prompt_tokens
    assert [r.replica_id for r in choice.order[1:]] == [r for r in IDS if r != elsewhere]


def test_the_catalogs_policy_applies() -> None:
    affinity = Affinity()
    least = _spec(policy="least_loaded")
    key = _turns(1, 1)
    affinity.served("m", "r3", key, Choice([], Reason.PREFIX, 0), None, None)
    assert affinity.choose(least, _routes(), _turns(1, 2)).reason is Reason.LEAST_LOADED
    rr = _spec(policy=RoutingPolicyKind.ROUND_ROBIN)
    firsts = [affinity.choose(rr, _routes(), key).order[0].replica_id for _ in range(4)]
    assert sorted(firsts) == IDS
    assert affinity.choose(_spec(), [], key).order == []
    # No catalog entry (a model it no longer lists): the default policy, fallback capacity.
    assert affinity.choose(None, _routes("gone"), key).reason is Reason.RENDEZVOUS


def test_an_engine_reporting_fewer_cached_tokens_corrects_the_index() -> None:
    affinity, spec = Affinity(), _spec(context=1300)
    old, new = _turns(1, 1), _turns(2, 1)
    affinity.choose(spec, _routes(), old)  # the model's index, sized from its spec
    for key in (old, new):
        affinity.served("m", "r0", key, Choice([], Reason.PREFIX, 0), None, None)
    held = affinity.held_tokens("m", "r0")
    assert new.prompt_tokens < held <= 1300  # both held (the system prompt once)
    # Within the tolerance of the router's estimates: nothing corrected.
    predicted = new.prompt_tokens
    close = predicted - predicted // 10
    affinity.served("m", "r0", new, Choice([], Reason.PREFIX, predicted), predicted, close)
    assert affinity.held_tokens("m", "r0") == held
    # Far fewer: the capacity estimate shrinks (3/4 of 1300 = 975) and the
    # least recently served chains are evicted to fit: old's own turn first,
    # then the tail of new's (the prompt just served is the most recent).
    affinity.served("m", "r0", new, Choice([], Reason.PREFIX, predicted), predicted * 2, 10)
    assert affinity.held_tokens("m", "r0") <= 975
    choice = affinity.choose(spec, _routes(), _turns(1, 2))
    assert choice.predicted < old.prompt_tokens  # old's turn is no longer predicted held


def test_a_shortfall_within_one_engine_block_is_no_miss() -> None:
    """vLLM caches whole blocks (128 tokens on CPUs): a follow-up finds its
    history down to a block boundary. A prompt of ~375 tokens found 100
    short is a miss for llama.cpp (past 1/8: the replica's capacity estimate
    shrinks to 3/4, so two such prompts no longer fit), not for vLLM on CPU."""

    def key(word: str) -> PromptKey:
        made = prompt_key({"messages": [{"role": "user", "content": f"{word} " * 300}]}, 256)
        assert made is not None
        return made

    first, second = key("word"), key("wore")
    short = first.prompt_tokens - 100
    assert first.prompt_tokens // 8 < 100 < VLLM_BLOCK_CPU
    held = {}
    for engine in (EngineKind.LLAMA_CPP, EngineKind.VLLM):
        spec = ModelSpec(
            name="m", source="/w", engine=engine, context_length=1000,
            profile=EngineProfile(device="cpu"), routing=RoutingPolicy(cache_tokens=800),
        )  # fmt: skip
        affinity = Affinity()
        affinity.choose(spec, _routes(), first)
        affinity.served("m", "r0", first, Choice([], Reason.PREFIX, 0), None, None)
        choice = Choice([], Reason.PREFIX, first.prompt_tokens)
        affinity.served("m", "r0", first, choice, first.prompt_tokens, short)
        affinity.served("m", "r0", second, Choice([], Reason.PREFIX, 0), None, None)
        held[engine] = affinity.held_tokens("m", "r0")
    assert held[EngineKind.VLLM] == first.prompt_tokens + second.prompt_tokens  # both fit 800
    assert held[EngineKind.LLAMA_CPP] == second.prompt_tokens  # 600 now: the first evicted


def test_the_cache_block_is_vllms_block_size_or_its_default() -> None:
    def block(engine: EngineKind, device: str = "cuda", *args: str) -> int:
        profile = EngineProfile.model_validate({"device": device})
        spec = ModelSpec(
            name="m", source="/w", engine=engine, engine_args=list(args), profile=profile
        )
        return cache_block_tokens(spec)

    assert block(EngineKind.VLLM) == VLLM_BLOCK_GPU
    assert block(EngineKind.VLLM, "cpu") == VLLM_BLOCK_CPU
    assert block(EngineKind.VLLM, "cpu", "--block-size", "32") == 32
    assert block(EngineKind.VLLM, "cuda", "--block-size=32") == 32
    assert block(EngineKind.LLAMA_CPP, "cpu") == block(EngineKind.SGLANG) == 1


def test_reported_counts_are_scaled_to_the_routers_estimates() -> None:
    """The engine counts real tokens, the router estimates: a report equal to
    the engine's own prompt count is a full hit, however the counts differ."""
    affinity, spec = Affinity(), _spec(context=1300)
    old, new = _turns(1, 1), _turns(2, 1)
    affinity.choose(spec, _routes(), old)
    for key in (old, new):
        affinity.served("m", "r0", key, Choice([], Reason.PREFIX, 0), None, None)
    held = affinity.held_tokens("m", "r0")
    for engine_prompt in (new.prompt_tokens * 3, new.prompt_tokens // 2):  # finer, coarser
        choice = Choice([], Reason.PREFIX, new.prompt_tokens)
        affinity.served("m", "r0", new, choice, engine_prompt, engine_prompt - 1)
        assert affinity.held_tokens("m", "r0") == held  # no correction: nothing evicted


def test_forget_drops_a_replica_in_every_model_and_its_sticky_keys() -> None:
    affinity = Affinity()
    key = _turns(1, 1, sticky="session:s")
    for model in ("a", "b"):
        for replica in ("r0", "r1"):
            affinity.served(model, replica, key, Choice([], Reason.PREFIX, 0), None, None)
    affinity.forget("r1")
    assert affinity.held_tokens("a", "r1") == affinity.held_tokens("b", "r1") == 0
    assert affinity.held_tokens("a", "r0") > 0 and affinity.held_tokens("b", "r0") > 0
    # The sticky key pointed at r1 (served last): gone with it.
    choice = affinity.choose(_spec("a"), _routes("a", ["r1", "r2"]), _turns(1, 2, "session:s"))
    assert choice.reason is not Reason.STICKY


def test_a_sticky_key_scores_its_last_replica_as_holding_its_previous_prompt() -> None:
    now = [0.0]
    affinity = Affinity(clock=lambda: now[0], max_sticky=2)
    spec = _spec(context=1000)  # too small to keep the chain in the index
    first = _turns(1, 1, sticky="user:k:alice")
    affinity.choose(spec, _routes(), first)
    affinity.served("m", "r2", first, Choice([], Reason.PREFIX, 0), None, None)
    assert affinity.held_tokens("m", "r2") < first.prompt_tokens  # evicted (capacity)
    follow = _turns(1, 2, sticky="user:k:alice")
    choice = affinity.choose(spec, _routes(), follow)
    assert choice.order[0].replica_id == "r2" and choice.reason is Reason.STICKY
    assert choice.predicted == first.prompt_tokens
    # Another conversation of the same user does not extend it: no sticky score.
    other = affinity.choose(spec, _routes(), _turns(9, 1, sticky="user:k:alice"))
    assert other.reason is not Reason.STICKY
    # Unused for the TTL: forgotten.
    now[0] = STICKY_TTL_S + 1
    assert affinity.choose(spec, _routes(), follow).reason is not Reason.STICKY


def test_sticky_keys_are_bounded_least_recently_used_first() -> None:
    affinity = Affinity(max_sticky=2)
    spec = _spec(context=1000)
    keys = {s: _turns(i, 1, sticky=f"session:{s}") for i, s in enumerate("abc")}
    for s in "abc":
        affinity.served("m", "r1", keys[s], Choice([], Reason.PREFIX, 0), None, None)
    reasons = {
        s: affinity.choose(spec, _routes(), _turns(i, 2, sticky=f"session:{s}")).reason
        for i, s in enumerate("abc")
    }
    assert reasons["a"] is not Reason.STICKY  # the oldest of three, bound two
    assert reasons["b"] is Reason.STICKY and reasons["c"] is Reason.STICKY


def test_the_default_capacity_follows_the_engine() -> None:
    spec = ModelSpec(name="m", source="/w.gguf", context_length=4096, routing={"slots": 0})
    assert capacity_tokens(spec) == 4096  # llama.cpp: -c is its whole KV cache, any -np
    # Left out, slots is four: a cache of the whole context per slot.
    assert capacity_tokens(ModelSpec(name="m", source="/w.gguf", context_length=4096)) == 4 * 4096
    parallel = spec.model_copy(update={"engine_args": ["-np", "8", "-c", "8192"]})
    assert capacity_tokens(parallel) == 8192
    profiled = spec.model_copy(
        update={"profile": EngineProfile(engine_args=("--ctx-size", "2048"))}
    )
    assert capacity_tokens(profiled) == 2048
    vllm = spec.model_copy(update={"engine": EngineKind.VLLM})
    assert capacity_tokens(vllm) == 4096 * POOL_CONTEXTS
    fixed = spec.model_copy(update={"routing": RoutingPolicy(cache_tokens=123_456)})
    assert capacity_tokens(fixed) == 123_456
    assert FALLBACK_CAPACITY > 0


def _engine_cached(cache: dict[str, set[int]], replica: str, key: PromptKey) -> int:
    """A stand-in engine: the leading run of the prompt it has processed before."""
    held, total = cache.setdefault(replica, set()), 0
    for chunk in key.chunks:
        if chunk.digest not in held:
            break
        total += chunk.tokens
    held.update(c.digest for c in key.chunks)
    return total


def _cached_ratio(routers: int) -> float:
    affinities = [Affinity() for _ in range(routers)]
    cache: dict[str, set[int]] = {}
    spec, cached, prompt = _spec(), 0, 0
    for rounds in range(1, 7):
        for conversation in range(16):
            key = _turns(conversation, rounds)
            affinity = affinities[(rounds + conversation) % routers]  # each turn: the other
            choice = affinity.choose(spec, _routes(), key)
            replica = choice.order[0].replica_id
            hit = _engine_cached(cache, replica, key)
            affinity.served("m", replica, key, choice, key.prompt_tokens, hit)
            cached, prompt = cached + hit, prompt + key.prompt_tokens
    return cached / prompt


def test_two_routers_alternating_turns_cache_about_as_well_as_one() -> None:
    one, two = _cached_ratio(1), _cached_ratio(2)
    assert one > 0.7  # most of every turn after the first is its history
    assert two >= 0.95 * one
