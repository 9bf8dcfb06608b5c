"""Cache-aware routing skipped where it cannot matter (issue 26): a model with
one replica and no pinned llama.cpp slots gets no prompt key and no ordering
by the Affinity, yet its served-token metrics (prompt and cached tokens per
replica: the hit ratio) are counted; with two replicas, or slots to pin, the
key is made; a second replica appearing later is simply learnt from then on.
The scripted caching engine and the recording Affinity: test_prefix_routing.py.
"""

from pathlib import Path

from llmgw.types import RoutingPolicy
from tests.gateway.test_prefix_routing import (
    REPLICAS,
    TOKENS_PER_MESSAGE,
    M,
    ask,
    metrics,
    model,
    routed,
    turns,
    until,
)


def counted(text: str, metric: str, replica: str) -> float:
    """A per-replica router counter's value in the /metrics text (0: absent)."""
    prefix = f'llmgw_router_{metric}{{model="{M}",replica="{replica}"}} '
    values = [
        float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix)
    ]
    return values[0] if values else 0.0


async def test_a_one_replica_model_gets_no_key_yet_its_served_tokens_are_counted(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path, replicas=REPLICAS[:1]) as r:
        _, key = r.gw.key()
        for n in (1, 2, 3):
            replica = (await ask(r.gw, key, turns("one", n), n == 2)).headers["x-llmgw-replica"]
            assert replica == "r1"
        # Nothing to choose: the Affinity was neither asked to order nor told
        # to learn (no prompt key was made), and holds nothing of the model.
        assert r.affinity.keys == []
        assert r.affinity.served_calls == []
        assert r.affinity.held_tokens(M, "r1") == 0
        # The engine's own counts still reach the metrics: each turn's whole
        # prompt, and the cached previous one (the engine's cache needs no router).
        text = await metrics(r.gw)
        assert counted(text, "prompt_tokens_total", "r1") == TOKENS_PER_MESSAGE * (2 + 4 + 6)
        assert counted(text, "cached_tokens_total", "r1") == TOKENS_PER_MESSAGE * (2 + 4)
        assert f'llmgw_router_route_choices_total{{model="{M}",reason="least_loaded"}} 3.0' in text


async def test_two_replicas_get_the_key_and_learn(tmp_path: Path) -> None:
    async with routed(tmp_path, replicas=REPLICAS[:2]) as r:
        _, key = r.gw.key()
        first = (await ask(r.gw, key, turns("two", 1))).headers["x-llmgw-replica"]
        second = (await ask(r.gw, key, turns("two", 2))).headers["x-llmgw-replica"]
        assert second == first  # where its history is held
        assert len(r.affinity.keys) == 2 and None not in r.affinity.keys
        assert [s.key for s in r.affinity.served_calls] == r.affinity.keys
        assert r.affinity.held_tokens(M, first) > 0


async def test_one_replica_with_slots_to_pin_gets_the_key(tmp_path: Path) -> None:
    slots = model().model_copy(update={"routing": RoutingPolicy(slots=2)})
    async with routed(tmp_path, spec_=slots, replicas=REPLICAS[:1]) as r:
        _, key = r.gw.key()
        await ask(r.gw, key, turns("slots", 1))
        assert len(r.affinity.keys) == 1 and r.affinity.keys[0] is not None
        assert len(r.affinity.served_calls) == 1


async def test_a_second_replica_appearing_is_learnt_from_then_on(tmp_path: Path) -> None:
    async with routed(tmp_path, replicas=REPLICAS[:1]) as r:
        _, key = r.gw.key()
        await ask(r.gw, key, turns("grow", 1))
        assert r.affinity.keys == []
        assert r.gw.source is not None
        r.gw.source.items = list(REPLICAS[:2])
        await until(lambda: len(r.table.routes.get(M, ())) == 2)
        # The index starts empty: the turn goes by the rendezvous hash of its
        # lead, and is recorded where it went; the next follows it there.
        at = (await ask(r.gw, key, turns("grow", 2))).headers["x-llmgw-replica"]
        assert len(r.affinity.keys) == 1 and r.affinity.keys[0] is not None
        assert [s.replica_id for s in r.affinity.served_calls] == [at]
        assert r.affinity.held_tokens(M, at) > 0
        again = (await ask(r.gw, key, turns("grow", 3))).headers["x-llmgw-replica"]
        assert again == at
