"""Issue 23 item 7: one tenant can neither fill a model's admission queue nor
grow the router's memory by joining and leaving it.

- a key that floods gets ``queue_full`` past its share of ``queue.max_waiting``
  (``queue.key_share``), and a light key still gets a place and is served;
- the fair queue's heap stays within twice its live entries under 200,000
  join-and-leave cycles while another request waits all along (the removed
  entries were kept until the class emptied: 200,001 heap entries)."""

import asyncio
import tracemalloc
from pathlib import Path

from llmgw.types import Priority, QueuePolicy
from router.admission.fair_queue import COMPACT_MIN_DEAD, FairQueue
from router.admission.queue import key_share
from tests.gateway.test_admission import GatedEngine, chat, post, queued, until, waiting
from tests.gateway_util import ADMIN_KEY, auth, gateway, ready

M = "m1"
CHAT = "/v1/chat/completions"


def test_a_key_share_is_a_part_of_max_waiting_and_at_least_one() -> None:
    assert key_share(QueuePolicy(max_waiting=256)) == 128  # the default: half
    assert key_share(QueuePolicy(max_waiting=10, key_share=0.25)) == 2
    assert key_share(QueuePolicy(max_waiting=1, key_share=0.1)) == 1
    assert key_share(QueuePolicy(max_waiting=10, key_share=1.0)) == 10


async def test_a_flooding_key_leaves_room_for_a_light_key(tmp_path: Path) -> None:
    engine = GatedEngine()
    models = [queued(M, max_waiting=8, key_share=0.5)]
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], models, engine) as gw:
        _, flooder = gw.key()
        _, light = gw.key()
        mine = [{"role": "user", "content": "light"}]
        # One in flight, a light request waits, then the flooder's share (4)
        # waits; the rest is refused while the light key waits.
        floods = [post(gw, flooder)]
        await until(lambda: len(engine.gates) == 1)
        lights = [post(gw, light, messages=mine)]
        await until(lambda: waiting(gw) == 1)
        floods += [post(gw, flooder) for _ in range(4)]
        await until(lambda: waiting(gw) == 5)
        refused = [await gw.http.post(CHAT, json=chat(), headers=auth(flooder)) for _ in range(3)]
        for r in refused:
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert "key_share" in r.json()["error"]["message"]
        assert waiting(gw) == 5
        # The light key still has a place, and is served ahead of the backlog
        # (fair queuing), not refused.
        lights.append(post(gw, light, messages=mine))
        await until(lambda: waiting(gw) == 6)
        for i in range(7):
            await until(lambda i=i: len(engine.gates) > i)  # type: ignore[misc]
            engine.gates[i].set()
        results = await asyncio.gather(*floods, *lights)
        assert [r.status_code for r in results] == [200] * 7
        order = ["light" if engine.body(i)["messages"] == mine else "flood" for i in range(7)]
        # Served alternately with the backlog (fair queuing on the estimated cost).
        assert order == ["flood", "flood", "light", "flood", "light", "flood", "flood"], order
        assert 'reason="key_share"' in (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text


async def test_a_key_waiting_alone_may_fill_the_queue(tmp_path: Path) -> None:
    # A single-key install keeps the whole queue: the share binds only while
    # another key waits.
    engine = GatedEngine()
    models = [queued(M, max_waiting=8, key_share=0.5)]
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], models, engine) as gw:
        _, only = gw.key()
        sent = [post(gw, only)]
        await until(lambda: len(engine.gates) == 1)
        sent += [post(gw, only) for _ in range(8)]
        await until(lambda: waiting(gw) == 8)
        r = await gw.http.post(CHAT, json=chat(), headers=auth(only))
        assert r.status_code == 503 and "key_share" not in r.json()["error"]["message"]
        for i in range(9):
            await until(lambda i=i: len(engine.gates) > i)  # type: ignore[misc]
            engine.gates[i].set()
        assert [r.status_code for r in await asyncio.gather(*sent)] == [200] * 9


def test_heap_stays_bounded_under_join_and_leave_churn() -> None:
    q: FairQueue[int] = FairQueue()
    q.push(0, key=1, cost=10)  # waits all along: the class never empties
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        peak_len = 0
        for i in range(200_000):
            entry = q.push(i, key=2 + i % 50, cost=10)
            assert q.remove(entry)
            peak_len = max(peak_len, q.heap_len())
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(q) == 1
    assert peak_len <= 2 * COMPACT_MIN_DEAD + 2, peak_len
    # Was ~54 MiB for the kept tombstones; now a few KiB.
    assert grown - base < 256 * 1024, grown - base
    first = q.pop()
    assert first is not None and first.item == 0
    assert q.pop() is None and q.heap_len() == 0


def test_compaction_keeps_the_fair_order() -> None:
    q: FairQueue[str] = FairQueue()
    kept = [q.push(f"a{i}", key=1, cost=10) for i in range(5)]
    gone = [q.push(f"b{i}", key=2, cost=1) for i in range(3 * COMPACT_MIN_DEAD)]
    for entry in gone:
        q.remove(entry)
    assert q.heap_len() < len(kept) + len(gone)  # compacted on the way
    q.push("c", key=3, cost=1)
    order = []
    while (e := q.pop()) is not None:
        order.append(e.item)
    assert order[0] == "c" and order[1:] == [e.item for e in kept]
    assert q.waiting_of(1) == q.waiting_of(3) == 0


def test_waiting_of_counts_a_key_across_classes() -> None:
    q: FairQueue[str] = FairQueue()
    a = q.push("a", key=1, cost=1, priority=Priority.HIGH)
    q.push("b", key=1, cost=1, priority=Priority.BATCH)
    q.push("c", key=2, cost=1)
    assert q.waiting_of(1) == 2 and q.waiting_of(2) == 1
    q.remove(a)
    assert q.waiting_of(1) == 1
    assert q.pop() is not None and q.pop() is not None
    assert q.waiting_of(1) == 0 and q.waiting_of(2) == 0
