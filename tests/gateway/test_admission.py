"""The admission queue and the wake of a model at zero, in the router app with
a scripted engine and an injected deployment link (tests/gateway/
test_admission_llama.py runs the same against real llama.cpp engines)."""

import asyncio
import json
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.types import (
    AutoscalePolicy,
    LoadReport,
    ModelSpec,
    QueuePolicy,
    WakeInput,
    WakeResult,
)
from router.api.reservation import reserved_tokens
from router.api.schemas import ChatCompletionRequest
from tests.gateway_util import (
    ADMIN_KEY,
    FakeSource,
    Gateway,
    MockEngine,
    auth,
    gateway,
    post_scope,
    ready,
    spec,
)

M = "m1"
CHAT = "/v1/chat/completions"


def chat(**extra: object) -> dict[str, object]:
    return {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


def elastic(name: str = M, max_inflight: int = 1, **queue: Any) -> ModelSpec:
    """A model with autoscale (from zero) and the given queue bounds."""
    return spec(name, max_inflight=max_inflight).model_copy(
        update={"autoscale": AutoscalePolicy(min_replicas=0), "queue": QueuePolicy(**queue)}
    )


def queued(name: str = M, max_inflight: int = 1, **queue: Any) -> ModelSpec:
    return spec(name, max_inflight=max_inflight).model_copy(update={"queue": QueuePolicy(**queue)})


@dataclass
class FakeLink:
    """The deployments as a test plays them: wakes wait for ``answer``."""

    wakes: list[tuple[str, WakeInput]] = field(default_factory=list)
    reports: list[tuple[str, LoadReport]] = field(default_factory=list)
    answer: asyncio.Future[WakeResult] | None = None

    async def report(self, model: str, report: LoadReport) -> None:
        self.reports.append((model, report))

    async def wake(self, model: str, wake: WakeInput) -> WakeResult:
        self.wakes.append((model, wake))
        if self.answer is None:
            self.answer = asyncio.get_running_loop().create_future()
        return await self.answer


class GatedEngine(MockEngine):
    """Each request waits for its own gate; counts how many are inside at once."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[asyncio.Event] = []
        self.inside = 0
        self.peak = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        gate = asyncio.Event()
        self.gates.append(gate)
        try:
            await gate.wait()
            return await super().handle(request)
        finally:
            self.inside -= 1


async def until(cond: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


def post(gw: Gateway, key: str, **extra: object) -> "asyncio.Task[httpx.Response]":
    return asyncio.create_task(gw.http.post(CHAT, json=chat(**extra), headers=auth(key)))


def waiting(gw: Gateway) -> int:
    return int(gw.app.state.deps.admission.waiting(M))


async def metric(gw: Gateway, line_start: str) -> str:
    text = (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text
    return next((ln for ln in text.splitlines() if ln.startswith(line_start)), "")


async def test_a_saturated_model_queues_and_serves_everyone(tmp_path: Path) -> None:
    engine = GatedEngine()
    one = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", one, [spec(M, 1)], engine) as gw:
        _, key = gw.key()
        tasks = [post(gw, key) for _ in range(5)]
        await until(lambda: len(engine.gates) == 1 and waiting(gw) == 4)
        assert await metric(gw, 'llmgw_queue_waiting{model="m1"}') == (
            'llmgw_queue_waiting{model="m1"} 4.0'
        )
        # Each finished request lets exactly one more through.
        for i in range(5):
            await until(lambda i=i: len(engine.gates) == i + 1)  # type: ignore[misc]
            engine.gates[i].set()
        results = await asyncio.gather(*tasks)
        assert [r.status_code for r in results] == [200] * 5
        assert engine.peak == 1
        assert waiting(gw) == 0
        text = (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text
        assert 'llmgw_queue_wait_seconds_count{model="m1"} 4.0' in text


async def test_max_waiting_answers_503_with_retry_after(tmp_path: Path) -> None:
    engine = GatedEngine()
    models = [queued(max_waiting=2, key_share=1.0)]  # the whole queue for one key
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], models, engine) as gw:
        _, key = gw.key()
        tasks = [post(gw, key) for _ in range(3)]
        await until(lambda: len(engine.gates) == 1 and waiting(gw) == 2)
        full = await gw.http.post(CHAT, json=chat(), headers=auth(key))
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        assert "max_waiting" in full.json()["error"]["message"]
        for gate_index in range(3):
            await until(lambda g=gate_index: len(engine.gates) > g)  # type: ignore[misc]
            engine.gates[gate_index].set()
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 3
        assert 'reason="full"' in (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text


async def test_max_wait_s_answers_503_with_retry_after(tmp_path: Path) -> None:
    engine = GatedEngine()
    models = [queued(max_wait_s=0.2)]
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], models, engine) as gw:
        _, key = gw.key()
        first = post(gw, key)
        await until(lambda: len(engine.gates) == 1)
        late = await gw.http.post(CHAT, json=chat(), headers=auth(key))
        assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
        assert int(late.headers["retry-after"]) >= 1
        assert waiting(gw) == 0
        engine.gates[0].set()
        assert (await first).status_code == 200


async def test_max_waiting_zero_keeps_the_instant_503(tmp_path: Path) -> None:
    engine = GatedEngine()
    models = [queued(max_waiting=0)]
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], models, engine) as gw:
        _, key = gw.key()
        first = post(gw, key)
        await until(lambda: len(engine.gates) == 1)
        r = await gw.http.post(CHAT, json=chat(), headers=auth(key))
        assert r.status_code == 503 and r.json()["error"]["code"] == "replicas_saturated"
        engine.gates[0].set()
        assert (await first).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_leaving_the_queue_is_not_billed_and_frees_its_quota(
    tmp_path: Path, stream: bool
) -> None:
    engine = GatedEngine()
    reservation = reserved_tokens(ChatCompletionRequest.model_validate(chat()), 512)
    one = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", one, [spec(M, 1)], engine) as gw:
        gw.app.state.deps.admission.stream_quiet_s = 0.0  # a waiting stream gets its 200 at once
        key_id, key = gw.key(tpm=2 * reservation)
        first = post(gw, key)
        await until(lambda: len(engine.gates) == 1)
        gone = asyncio.Event()
        sent: list[MutableMapping[str, Any]] = []
        body = json.dumps(chat(stream=stream)).encode()
        read: list[bool] = []

        async def receive() -> dict[str, object]:
            if not read:
                read.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        leaving = asyncio.create_task(gw.app(post_scope(CHAT, key), receive, send))
        await until(lambda: waiting(gw) == 1)
        if stream:
            await until(lambda: bool(sent))
            assert sent[0]["status"] == 200
        gone.set()
        async with asyncio.timeout(5):
            await leaving
        assert waiting(gw) == 0
        assert await metric(gw, 'llmgw_queue_waiting{model="m1"}') == (
            'llmgw_queue_waiting{model="m1"} 0.0'
        )
        assert engine.gates[1:] == []  # it never reached the engine
        # Its reservation is back: one more request fits the key's minute.
        await gw.app.state.deps.accountant.flush()
        third = post(gw, key)
        engine.gates[0].set()
        assert (await first).status_code == 200
        await until(lambda: len(engine.gates) == 2)
        engine.gates[1].set()
        assert (await third).status_code == 200
        await gw.app.state.deps.accountant.flush()
        rows = (await gw.http.get("/admin/usage", headers=auth(ADMIN_KEY))).json()
    [row] = [r for r in rows if r["key_id"] == key_id]
    # Two served (7 prompt + 3 completion tokens each); the one that left: nothing.
    assert (row["requests"], row["errors"]) == (3, 1)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (14, 6)


async def test_twenty_requests_for_a_model_at_zero_wake_it_once(tmp_path: Path) -> None:
    link = FakeLink()
    source_models = [elastic()]
    async with gateway(tmp_path / "s.db", [], source_models, deployment_link=link) as gw:
        _, key = gw.key()
        listed = (await gw.http.get("/v1/models", headers=auth(key))).json()["data"]
        assert [(m["id"], m["llmgw_state"]) for m in listed] == [(M, "scaled-to-zero")]
        tasks = [post(gw, key) for _ in range(20)]
        await until(lambda: waiting(gw) == 20 and link.answer is not None)
        assert [m for m, _ in link.wakes] == [M]
        listed = (await gw.http.get("/v1/models", headers=auth(key))).json()["data"]
        assert listed[0]["llmgw_state"] == "waking"
        # The replica shows up in the routing table; the deployment answers.
        source: FakeSource = _source(gw)
        source.items = [ready("r1", M, "http://e1:1")]
        assert link.answer is not None
        link.answer.set_result(WakeResult(ready=True, desired=1))
        results = await asyncio.gather(*tasks)
        assert [r.status_code for r in results] == [200] * 20
        assert len(link.wakes) == 1
        assert (
            'llmgw_wakes_total{model="m1",result="ready"} 1.0'
            in (await gw.http.get("/metrics", headers=auth(ADMIN_KEY))).text
        )


async def test_a_ready_wake_reads_the_routing_table_at_once(tmp_path: Path) -> None:
    """The table is not left to its interval (an hour here) once a wake answers
    ready, and is read again while it lacks the replica (visibility lags)."""
    link = FakeLink()
    async with gateway(
        tmp_path / "s.db", [], [elastic()], deployment_link=link, refresh_interval_s=3600
    ) as gw:
        _, key = gw.key()
        source = _source(gw)
        tasks = [post(gw, key) for _ in range(3)]
        await until(lambda: waiting(gw) == 3 and link.answer is not None)
        reads = source.reads
        assert link.answer is not None
        link.answer.set_result(WakeResult(ready=True, desired=1))
        # Read at once, and again: the replica is not listed yet.
        await until(lambda: source.reads >= reads + 2)
        assert waiting(gw) == 3
        source.items = [ready("r1", M, "http://e1:1")]
        results = await asyncio.gather(*tasks)
        assert [r.status_code for r in results] == [200] * 3
        assert len(link.wakes) == 1


def _source(gw: Gateway) -> FakeSource:
    assert gw.source is not None
    return gw.source


async def test_a_failed_wake_answers_every_waiting_request_with_its_reason(
    tmp_path: Path,
) -> None:
    link = FakeLink()
    async with gateway(tmp_path / "s.db", [], [elastic()], deployment_link=link) as gw:
        _, key = gw.key()
        gw.app.state.deps.admission.stream_quiet_s = 0.0  # a waiting stream gets its 200 at once
        tasks = [post(gw, key) for _ in range(3)]
        streamed = post(gw, key, stream=True)
        await until(lambda: waiting(gw) == 4 and link.answer is not None)
        assert link.answer is not None
        link.answer.set_result(WakeResult(ready=False, reason="no node has 80 GiB of GPU memory"))
        for r in await asyncio.gather(*tasks):
            assert r.status_code == 503 and r.json()["error"]["code"] == "wake_failed"
            # Why is for admins (tests/gateway/test_error_ids.py): the client gets an id.
            assert "80 GiB" not in r.text and r.headers["x-request-id"] in r.text
        # The stream had its 200 already: the failure is its last event.
        s = await streamed
        assert s.status_code == 200
        assert s.text.startswith(": waiting for a replica") or s.text.startswith("data: ")
        last = s.text.strip().splitlines()[-1]
        assert last.startswith("data: ") and json.loads(last[6:])["error"]["code"] == "wake_failed"
        assert waiting(gw) == 0
        # The next request wakes again.
        link.answer = None
        again = post(gw, key)
        await until(lambda: len(link.wakes) == 2)
        assert link.answer is not None
        link.answer.set_result(WakeResult(ready=False, reason="still no GPU"))
        assert (await again).json()["error"]["code"] == "wake_failed"


async def test_a_stream_waiting_for_a_wake_gets_comments_then_its_events(tmp_path: Path) -> None:
    link = FakeLink()
    async with gateway(tmp_path / "s.db", [], [elastic()], deployment_link=link) as gw:
        _, key = gw.key()
        admission = gw.app.state.deps.admission
        admission.stream_quiet_s = 0.0  # a waiting stream gets its 200 at once
        admission.stream_comment_s = 0.02
        streamed = post(gw, key, stream=True)
        await until(lambda: waiting(gw) == 1 and link.answer is not None)
        # A few comment periods pass before the replica is ready.
        await until(lambda: admission.clock() - _enqueued(admission) > 0.1)
        _source(gw).items = [ready("r1", M, "http://e1:1")]
        assert link.answer is not None
        link.answer.set_result(WakeResult(ready=True, desired=1))
        s = await streamed
    assert s.status_code == 200
    events = [e for e in s.text.split("\n\n") if e]
    comments = [e for e in events if e.startswith(":")]
    data = [e for e in events if e.startswith("data: ")]
    assert len(comments) >= 2 and events[0] == ": waiting for a replica"
    assert data[-1] == "data: [DONE]"
    assert "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in data[:3])
    # The hidden usage stays hidden after a wait too.
    assert all('"usage"' not in e for e in data)


def _enqueued(admission: Any) -> float:
    tickets = [t for m in admission._models.values() for t in m.fair.items()]
    return float(min(t.enqueued for t in tickets)) if tickets else admission.clock()


async def test_a_model_without_autoscale_and_no_replica_still_answers_503(tmp_path: Path) -> None:
    link = FakeLink()
    async with gateway(tmp_path / "s.db", [], [spec(M)], deployment_link=link) as gw:
        _, key = gw.key()
        r = await gw.http.post(CHAT, json=chat(), headers=auth(key))
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"
        assert link.wakes == []
        assert (await gw.http.get("/v1/models", headers=auth(key))).json()["data"] == []


async def test_loads_are_reported_for_autoscaled_models_then_a_final_zero(tmp_path: Path) -> None:
    link = FakeLink()
    models = [elastic(max_inflight=0), spec("fixed")]
    replicas = [ready("r1", M, "http://e1:1"), ready("r2", "fixed", "http://e2:1")]
    async with gateway(
        tmp_path / "s.db", replicas, models, deployment_link=link, load_report_interval_s=0.05,
        router_id="router-a",
    ) as gw:  # fmt: skip
        _, key = gw.key()
        for model in (M, M, "fixed"):
            body = {**chat(), "model": model}
            assert (await gw.http.post(CHAT, json=body, headers=auth(key))).status_code == 200

        def settled() -> bool:
            # Every request reported, then the load's end.
            arrived = sum(r.load.arrivals for _, r in link.reports) == 2
            tokens = sum(r.load.tokens for _, r in link.reports) == 2 * (7 + 3)
            last = link.reports[-1][1].load if link.reports else None
            return arrived and tokens and last is not None and not last.arrivals + last.tokens

        await until(settled)
    assert {m for m, _ in link.reports} == {M}
    assert all(r.router_id == "router-a" for _, r in link.reports)
    assert sum(r.load.arrivals for _, r in link.reports) == 2
    assert sum(r.load.tokens for _, r in link.reports) == 2 * (7 + 3)
    # The load stopped: one report of zero, then none (tests/gateway/test_load_report.py).
    last = link.reports[-1][1].load
    assert (last.inflight, last.waiting, last.arrivals, last.tokens) == (0, 0, 0, 0)


class RefusingEngine(MockEngine):
    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        error = {"message": "the prompt is too long", "type": "invalid_request_error"}
        return httpx.Response(400, json={"error": error})


async def test_an_engine_refusal_after_the_wait_is_the_streams_error_event(
    tmp_path: Path,
) -> None:
    link = FakeLink()
    engine = RefusingEngine()
    async with gateway(tmp_path / "s.db", [], [elastic()], engine, deployment_link=link) as gw:
        _, key = gw.key()
        gw.app.state.deps.admission.stream_quiet_s = 0.0  # a waiting stream gets its 200 at once
        streamed = post(gw, key, stream=True)
        await until(lambda: waiting(gw) == 1 and link.answer is not None)
        _source(gw).items = [ready("r1", M, "http://e1:1")]
        assert link.answer is not None
        link.answer.set_result(WakeResult(ready=True, desired=1))
        s = await streamed
        assert s.status_code == 200 and len(engine.seen) == 1
        last = s.text.strip().splitlines()[-1]
        assert json.loads(last.removeprefix("data: "))["error"]["message"] == (
            "the prompt is too long"
        )
        await gw.app.state.deps.accountant.flush()
        rows = (await gw.http.get("/admin/usage", headers=auth(ADMIN_KEY))).json()
    assert [(r["requests"], r["errors"]) for r in rows] == [(1, 1)]


async def test_a_high_priority_key_goes_before_those_waiting_already(tmp_path: Path) -> None:
    engine = GatedEngine()
    one = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", one, [spec(M, 1)], engine) as gw:
        _, normal = gw.key()
        _, batch = gw.key(priority="batch")
        _, high = gw.key(priority="high", weight=5)
        first = post(gw, normal, user="first")
        await until(lambda: len(engine.gates) == 1)
        tasks = [post(gw, batch, user="batch")]
        await until(lambda: waiting(gw) == 1)
        tasks += [post(gw, normal, user=f"normal{i}") for i in range(2)]
        await until(lambda: waiting(gw) == 3)
        tasks.append(post(gw, high, user="high"))
        await until(lambda: waiting(gw) == 4)
        for i in range(5):
            await until(lambda i=i: len(engine.gates) == i + 1)  # type: ignore[misc]
            engine.gates[i].set()
        assert all(r.status_code == 200 for r in await asyncio.gather(first, *tasks))
    order = [json.loads(r.content)["user"] for r in engine.seen]
    assert order == ["first", "high", "normal0", "normal1", "batch"]
