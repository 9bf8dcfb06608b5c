"""The admission queue's order, without a server: priority classes strictly,
then weighted fair queuing on tokens across keys; a request's cost."""

from collections import Counter

from llmgw.types import Priority
from router.admission.fair_queue import FairQueue
from router.api.schemas import (
    DEFAULT_COMPLETION_COST,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    queue_cost,
)

A, B, C = 1, 2, 3


def served(q: FairQueue[str], n: int) -> list[str]:
    out: list[str] = []
    for _ in range(n):
        entry = q.pop()
        assert entry is not None
        out.append(entry.item)
    return out


def test_a_flooding_key_does_not_starve_a_light_one() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(100):
        q.push("a", A, cost=100)
    for _ in range(10):
        q.push("b", B, cost=100)
    # B's ten requests go within the first twenty, alternating with A's.
    assert Counter(served(q, 20)) == {"a": 10, "b": 10}
    assert set(served(q, 90)) == {"a"}
    assert q.pop() is None and len(q) == 0


def test_a_newcomer_overtakes_a_backlog() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(50):
        q.push("a", A, cost=10)
    served(q, 5)
    q.push("b", B, cost=10)
    assert "b" in served(q, 2)


def test_weights_share_the_tokens() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(200):
        q.push("a", A, cost=50, weight=3)
        q.push("b", B, cost=50, weight=1)
    counts = Counter(served(q, 100))
    assert abs(counts["a"] - 75) <= 1 and abs(counts["b"] - 25) <= 1


def test_fairness_is_on_tokens_not_requests() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(100):
        q.push("big", A, cost=300)
        q.push("small", B, cost=100)
    counts = Counter(served(q, 40))
    # Equal tokens: three small requests for each big one.
    assert abs(counts["small"] - 30) <= 1 and abs(counts["big"] - 10) <= 1


def test_three_keys_equal_shares_whatever_they_queue() -> None:
    q: FairQueue[str] = FairQueue()
    for key, name, n in ((A, "a", 300), (B, "b", 30), (C, "c", 3)):
        for _ in range(n):
            q.push(name, key, cost=20)
    # c's three go within the first nine, b's thirty within the first ninety-three.
    assert Counter(served(q, 9))["c"] == 3
    assert Counter(served(q, 84))["b"] == 30 - 3


def test_priority_classes_are_served_strictly_in_order() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push(f"batch{i}", A, cost=1, priority=Priority.BATCH)
    for i in range(3):
        q.push(f"normal{i}", B, cost=1_000_000)  # costly, still before any batch
    q.push("high", C, cost=1_000_000, priority=Priority.HIGH)
    order = served(q, 7)
    assert order == ["high", "normal0", "normal1", "normal2", "batch0", "batch1", "batch2"]
    assert q.depth(Priority.BATCH) == 0


def test_fairness_holds_within_a_class() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(20):
        q.push("a", A, cost=10, priority=Priority.BATCH)
    for _ in range(2):
        q.push("b", B, cost=10, priority=Priority.BATCH)
    assert Counter(served(q, 4)) == {"a": 2, "b": 2}


def test_removed_entries_are_never_served() -> None:
    q: FairQueue[str] = FairQueue()
    first = q.push("gone", A, cost=1)
    q.push("stays", B, cost=1)
    assert q.remove(first) and not q.remove(first)
    assert len(q) == 1 and q.items() == ["stays"]
    entry = q.pop()
    assert entry is not None and entry.item == "stays"
    assert not q.remove(entry)  # served already
    assert q.pop() is None


def test_an_idle_key_gets_no_credit_for_its_idleness() -> None:
    q: FairQueue[str] = FairQueue()
    # B was served long ago; A has been alone since.
    q.push("b", B, cost=10)
    served(q, 1)
    for _ in range(30):
        q.push("a", A, cost=10)
    served(q, 20)
    for _ in range(10):
        q.push("b", B, cost=10)
    # B shares from now on: it does not take the next ten in a row.
    assert Counter(served(q, 10)) == {"a": 5, "b": 5}


def test_a_requests_cost_is_its_prompt_and_what_it_may_generate() -> None:
    def chat(**extra: object) -> ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        return ChatCompletionRequest.model_validate(body)

    assert queue_cost(chat(max_tokens=10), 100) == 110
    assert queue_cost(chat(max_tokens=10, n=3), 100) == 130
    # Unbounded: a default, not the whole context the quota reserves.
    assert queue_cost(chat(), 100) == 100 + DEFAULT_COMPLETION_COST
    batch = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "max_tokens": 5})
    assert queue_cost(batch, 10) == 10 + 2 * 5
    embed = EmbeddingRequest.model_validate({"model": "m", "input": "hello"})
    assert queue_cost(embed, 7) == 7
