"""Batch-class admission (router/admission/queue.py): interactive requests
always go first. The rule purely, then in the router app with a gated engine
(tests/gateway/test_batch_priority_llama.py: the same on real llama.cpp)."""

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.engine_keys import exec_token
from llmgw.types import AutoscalePolicy, QueuePolicy, WakeResult
from router.admission.queue import batch_may_go
from tests.gateway.test_admission import FakeLink
from tests.gateway_util import Gateway, MockEngine, auth, gateway, ready, spec

M = "m1"
CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("free", "headroom", "interactive", "go"),
    [
        (0, 0, 0, False),  # no slot: nobody goes
        (0, 1, 0, False),
        (1, 1, 0, True),  # no interactive request there: any free slot
        (1, 1, 1, False),  # the last slot stays for interactive requests
        (2, 1, 1, True),  # past the headroom
        (2, 2, 3, False),
        (1, 0, 5, True),  # headroom 0: only the queue's class order
    ],
)
def test_batch_may_go(free: int, headroom: int, interactive: int, go: bool) -> None:
    assert batch_may_go(free, headroom, interactive) is go


class TaggedEngine(MockEngine):
    """Records each request's tag (its message) on arrival; each waits for its gate."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        tag = json.loads(request.content)["messages"][0]["content"]
        gate = self.gates.setdefault(tag, asyncio.Event())
        self.order.append(tag)
        await gate.wait()
        return await super().handle(request)

    def open(self, tag: str) -> None:
        self.gates.setdefault(tag, asyncio.Event()).set()


async def until(cond: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


def model(max_inflight: int, **queue: Any) -> list[Any]:
    return [spec(M, max_inflight).model_copy(update={"queue": QueuePolicy(**queue)})]


def send(gw: Gateway, tag: str, headers: dict[str, str]) -> "asyncio.Task[httpx.Response]":
    body = {"model": M, "messages": [{"role": "user", "content": tag}], "max_tokens": 3}
    return asyncio.create_task(gw.http.post(CHAT, json=body, headers=headers))


def batch_headers(gw: Gateway, key_id: int) -> dict[str, str]:
    return {
        **auth(exec_token(gw.store.engine_key_secret(), key_id)),
        "X-Llmgw-Key-Id": str(key_id),
        "X-Llmgw-Priority": "batch",
    }


def waiting(gw: Gateway) -> int:
    return int(gw.app.state.deps.admission.waiting(M))


async def test_interactive_requests_are_served_before_queued_batch_ones(tmp_path: Path) -> None:
    engine = TaggedEngine()
    one = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", one, model(1, batch_headroom=0), engine) as gw:
        key_id, key = gw.key()
        first = send(gw, "i0", auth(key))
        await until(lambda: engine.order == ["i0"])
        batch = [send(gw, f"b{i}", batch_headers(gw, key_id)) for i in range(3)]
        await until(lambda: waiting(gw) == 3)
        late = [send(gw, f"i{i}", auth(key)) for i in (1, 2)]
        await until(lambda: waiting(gw) == 5)
        for tag in ("i0", "i1", "i2", "b0", "b1", "b2"):
            engine.open(tag)
        answers = await asyncio.gather(first, *batch, *late)
        assert [a.status_code for a in answers] == [200] * 6
        # The interactive requests that came after the batch lines went first.
        assert engine.order[:3] == ["i0", "i1", "i2"]
        assert sorted(engine.order[3:]) == ["b0", "b1", "b2"]


async def test_a_batch_line_leaves_the_headroom_to_interactive_requests(tmp_path: Path) -> None:
    engine = TaggedEngine()
    one = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", one, model(2, batch_headroom=1), engine) as gw:
        key_id, key = gw.key()
        first = send(gw, "i0", auth(key))
        await until(lambda: engine.order == ["i0"])
        # One slot free, an interactive request running: the batch line waits.
        line = send(gw, "b0", batch_headers(gw, key_id))
        await until(lambda: waiting(gw) == 1)
        # The interactive request after it takes the free slot at once.
        second = send(gw, "i1", auth(key))
        await until(lambda: engine.order == ["i0", "i1"])
        assert waiting(gw) == 1
        engine.open("i0")
        engine.open("i1")
        assert [(await t).status_code for t in (first, second)] == [200, 200]
        # No interactive request left: the line takes any free slot.
        await until(lambda: engine.order == ["i0", "i1", "b0"])
        engine.open("b0")
        assert (await line).status_code == 200


async def test_a_model_free_of_interactive_requests_runs_batch_on_every_slot(
    tmp_path: Path,
) -> None:
    engine = TaggedEngine()
    one = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", one, model(2, batch_headroom=1), engine) as gw:
        key_id, _ = gw.key()
        lines = [send(gw, f"b{i}", batch_headers(gw, key_id)) for i in range(3)]
        await until(lambda: len(engine.order) == 2 and waiting(gw) == 1)
        for i in range(3):
            engine.open(f"b{i}")
        assert [(await t).status_code for t in lines] == [200] * 3


async def test_batch_lines_are_bound_neither_by_key_share_nor_max_wait_s(tmp_path: Path) -> None:
    engine = TaggedEngine()
    one = [ready("r1", M, "http://e1:1")]
    queue = {"max_waiting": 4, "key_share": 0.25, "max_wait_s": 0.3, "batch_headroom": 0}
    async with gateway(tmp_path / "s.db", one, model(1, **queue), engine) as gw:
        key_id, _ = gw.key()
        _, other = gw.key()
        first = send(gw, "i0", auth(other))
        await until(lambda: engine.order == ["i0"])
        waits = send(gw, "i1", auth(other))
        await until(lambda: waiting(gw) == 1)
        # Another key waits, yet one key's lines pass its share (1 of 4).
        lines = [send(gw, f"b{i}", batch_headers(gw, key_id)) for i in range(3)]
        await until(lambda: waiting(gw) == 4)
        assert (await waits).json()["error"]["code"] == "queue_timeout"
        # A client request queued after the lines times out after max_wait_s...
        late = send(gw, "i2", auth(other))
        assert (await late).json()["error"]["code"] == "queue_timeout"
        # ... while the lines, queued before it, wait on.
        assert waiting(gw) == 3
        for tag in ("i0", "b0", "b1", "b2"):
            engine.open(tag)
        assert [(await t).status_code for t in (first, *lines)] == [200] * 4


async def test_a_batch_line_wakes_a_model_at_zero(tmp_path: Path) -> None:
    link = FakeLink()
    at_zero = [
        spec(M, 1).model_copy(
            update={"autoscale": AutoscalePolicy(min_replicas=0), "queue": QueuePolicy()}
        )
    ]
    engine = TaggedEngine()
    async with gateway(tmp_path / "s.db", [], at_zero, engine, deployment_link=link) as gw:
        key_id, _ = gw.key()
        lines = [send(gw, f"b{i}", batch_headers(gw, key_id)) for i in range(2)]
        await until(lambda: waiting(gw) == 2 and link.answer is not None)
        assert [m for m, _ in link.wakes] == [M]
        assert gw.source is not None and link.answer is not None
        gw.source.items = [ready("r1", M, "http://e1:1")]
        link.answer.set_result(WakeResult(ready=True, desired=1))
        for i in range(2):
            engine.open(f"b{i}")
        assert [(await t).status_code for t in lines] == [200, 200]
