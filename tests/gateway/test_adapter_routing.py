"""LoRA routing in the router, in process. Static adapters: holders only, the
llama.cpp id per replica. On demand: a fake loader standing in
for the AdapterLoad workflow (it counts loads; the router's own coalescing is
what makes 50 cold requests one load here) and scripted vLLM-like engines that
answer only for adapters they hold (404 otherwise, as vLLM does).

The workflow itself runs against the fake vLLM in tests/control/test_adapter_load.py;
the routing decision alone in tests/gateway/test_adapter_policy.py.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from llmgw.types import (
    AdapterLoadInput,
    AdapterLoadResult,
    AdapterSpec,
    EngineKind,
    EngineProfile,
    ModelSpec,
    ReplicaMemo,
    ReplicaPhase,
)
from router.control_link.adapters import AdapterUnavailable
from tests.gateway_util import FakeSource, Gateway, MockEngine, auth, gateway

BASE = "base"
ADAPTERS = ["a", "b", "c", "d"]


def memo(replica_id: str) -> ReplicaMemo:
    return ReplicaMemo(
        replica_id=replica_id,
        model=BASE,
        phase=ReplicaPhase.READY,
        node_id=f"node-{replica_id}",
        endpoint=f"http://{replica_id}:8000",
        engine="vllm",
    )


@dataclass
class Fleet:
    """Which adapters each fake engine holds; the loader changes it."""

    source: FakeSource
    held: dict[str, list[str]] = field(default_factory=dict)
    loads: list[AdapterLoadInput] = field(default_factory=list)
    fail_next: set[str] = field(default_factory=set)
    load_time_s: float = 0.0
    holds: dict[str, asyncio.Event] = field(default_factory=dict)  # adapter -> release
    arrived: list[str] = field(default_factory=list)  # models the engines were asked for
    memo_follows: bool = True  # False: the router knows only what it did itself
    busy_elsewhere: set[str] = field(default_factory=set)  # other routers' requests

    async def load(self, request: AdapterLoadInput) -> AdapterLoadResult:
        """The fake AdapterLoad: the engine changes, then the replica's memo."""
        self.loads.append(request)
        await asyncio.sleep(self.load_time_s)
        name, rid = request.adapter.name, request.replica_id
        if name in self.fail_next:
            self.fail_next.discard(name)
            raise AdapterUnavailable(f"No adapter found for {request.adapter.source}")
        if request.evict in self.busy_elsewhere:  # the node activity's refusal
            raise AdapterUnavailable(f"adapter {request.evict} has requests in flight", busy=True)
        held = self.held.setdefault(rid, [])
        if request.evict:
            held.remove(request.evict)
        held.append(name)
        for m in self.source.items:  # the adapters_changed signal, as the memo shows it
            if m.replica_id == rid and self.memo_follows:
                m.adapters = list(held)
        return AdapterLoadResult(replica_id=rid, adapter=name, loaded=True, evicted=request.evict)

    async def engine(self, request: httpx.Request) -> httpx.Response | None:
        """vLLM's answer to a model it does not hold (None: serve it)."""
        model = json.loads(request.content)["model"]
        if model not in self.held.get(request.url.host, []):
            return httpx.Response(404, json={"error": {"message": f"model {model} not found"}})
        self.arrived.append(model)
        if model in self.holds:
            await self.holds[model].wait()
        return None


class VllmLike(MockEngine):
    def __init__(self, fleet: Fleet) -> None:
        super().__init__()
        self.fleet = fleet

    async def handle(self, request: httpx.Request) -> httpx.Response:
        refused = await self.fleet.engine(request)
        return refused or await super().handle(request)


@asynccontextmanager
async def fleet_gateway(
    db: Path, replicas: list[str], max_loaded: int = 4, cap: int = 0
) -> AsyncIterator[tuple[Gateway, Fleet, str]]:
    # gateway() reads these same memo objects: the fake load's memo change reaches it.
    source = FakeSource([memo(r) for r in replicas])
    fleet = Fleet(source)
    base = ModelSpec(
        name=BASE,
        engine=EngineKind.VLLM,
        source="/models/base",
        profile=EngineProfile(runtime_lora=True, max_loaded_adapters=max_loaded, max_inflight=cap),
        adapters=[AdapterSpec(name=a, source=f"/adapters/{a}") for a in ADAPTERS],
    )
    async with gateway(
        db, source.items, [base], engine=VllmLike(fleet), adapter_loader=fleet
    ) as gw:
        _, key = gw.key()
        yield gw, fleet, key


async def ask(gw: Gateway, key: str, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))


async def until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not cond():
            await asyncio.sleep(0.005)


async def test_fifty_concurrent_requests_for_a_cold_adapter_load_it_once(tmp_path: Path) -> None:
    async with fleet_gateway(tmp_path / "s.db", ["r1", "r2"]) as (gw, fleet, key):
        fleet.load_time_s = 0.3  # every request arrives while the load runs
        answers = await asyncio.gather(*(ask(gw, key, "a") for _ in range(50)))
        assert [r.status_code for r in answers] == [200] * 50, answers[0].text
        assert [(x.replica_id, x.node_id, x.adapter.source) for x in fleet.loads] == [
            ("r1", "node-r1", "/adapters/a")
        ]
        assert {r.headers["x-llmgw-replica"] for r in answers} == {"r1"}
        assert fleet.arrived == ["a"] * 50  # vLLM selects by the model field, as sent
        # Warm: served without a load.
        assert (await ask(gw, key, "a")).status_code == 200
        assert len(fleet.loads) == 1


async def test_a_failed_load_is_a_clear_error_and_the_next_request_loads_again(
    tmp_path: Path,
) -> None:
    async with fleet_gateway(tmp_path / "s.db", ["r1"]) as (gw, fleet, key):
        fleet.fail_next.add("b")
        fleet.load_time_s = 0.1
        failed = await asyncio.gather(*(ask(gw, key, "b") for _ in range(5)))
        assert {r.status_code for r in failed} == {502}
        error = failed[0].json()["error"]
        assert error["code"] == "adapter_load_failed"
        # Why is in the log: the client sees no path of the node.
        assert "`b`" in error["message"] and "/adapters/b" not in error["message"]
        assert len(fleet.loads) == 1  # the waiters shared the failed load too
        ok = await ask(gw, key, "b")
        assert ok.status_code == 200, ok.text
        assert len(fleet.loads) == 2


@pytest.mark.parametrize("memo_follows", [True, False])
async def test_eviction_picks_the_lru_idle_adapter_never_one_in_flight(
    tmp_path: Path, memo_follows: bool
) -> None:
    async with fleet_gateway(tmp_path / "s.db", ["r1"], max_loaded=2) as (gw, fleet, key):
        fleet.memo_follows = memo_follows
        for name in ("a", "b", "a"):  # b is now the least recently used
            assert (await ask(gw, key, name)).status_code == 200
        assert (await ask(gw, key, "c")).status_code == 200
        assert fleet.loads[-1].evict == "b"
        assert fleet.held["r1"] == ["a", "c"]
        # A streamed request to a stays in flight; c is used after it.
        fleet.holds["a"] = asyncio.Event()
        streaming = asyncio.create_task(ask(gw, key, "a", stream=True))
        await until(lambda: fleet.arrived.count("a") == 3)
        assert (await ask(gw, key, "c")).status_code == 200
        # a is least recently used but busy: d takes c's place.
        assert (await ask(gw, key, "d")).status_code == 200, fleet.loads
        assert fleet.loads[-1].evict == "c", fleet.loads
        assert fleet.held["r1"] == ["a", "d"]
        fleet.holds["a"].set()
        assert (await streaming).status_code == 200
        # The stream's end released a (its last use): once d is used after it,
        # a is the idle least recently used one and goes next.
        assert (await ask(gw, key, "d")).status_code == 200
        assert (await ask(gw, key, "b")).status_code == 200
        assert fleet.loads[-1].evict == "a"


async def test_an_eviction_refused_as_busy_elsewhere_picks_another_victim(
    tmp_path: Path,
) -> None:
    async with fleet_gateway(tmp_path / "s.db", ["r1"], max_loaded=2) as (gw, fleet, key):
        for name in ("a", "b"):  # a is the least recently used
            assert (await ask(gw, key, name)).status_code == 200
        fleet.busy_elsewhere.add("a")  # another router's requests run on it
        r = await ask(gw, key, "c")
        assert r.status_code == 200, r.text
        assert [x.evict for x in fleet.loads[-2:]] == ["a", "b"]
        assert fleet.held["r1"] == ["a", "c"]
        # Once free, a is evictable again (the least recently used idle one).
        fleet.busy_elsewhere.clear()
        assert (await ask(gw, key, "c")).status_code == 200
        assert (await ask(gw, key, "b")).status_code == 200
        assert fleet.loads[-1].evict == "a"


async def test_an_adapter_another_router_unloaded_is_loaded_again_not_a_404(
    tmp_path: Path,
) -> None:
    """This router's view says r1 holds a (its memo lags); the engine answers
    404: the router loads a as for a cold adapter and answers the request."""
    async with fleet_gateway(tmp_path / "s.db", ["r1"]) as (gw, fleet, key):
        assert (await ask(gw, key, "a")).status_code == 200
        fleet.held["r1"].remove("a")  # unloaded by another router; the memo still shows it
        table = gw.app.state.deps.table
        await until(lambda: table.routes[BASE][0].adapters == ["a"])
        r = await ask(gw, key, "a")
        assert r.status_code == 200, r.text
        assert [x.adapter.name for x in fleet.loads] == ["a", "a"]
        assert fleet.held["r1"] == ["a"] and fleet.arrived == ["a", "a"]
        # Had the load not helped, the engine's 404 is the answer, once.
        fleet.held["r1"].remove("a")
        fleet.memo_follows = False
        fleet.fail_next.add("a")
        r = await ask(gw, key, "a")
        assert r.status_code == 502 and r.json()["error"]["code"] == "adapter_load_failed"
        assert len(fleet.loads) == 3


async def test_a_saturated_holder_makes_another_replica_load(tmp_path: Path) -> None:
    async with fleet_gateway(tmp_path / "s.db", ["r1", "r2"], cap=1) as (gw, fleet, key):
        assert (await ask(gw, key, "a")).headers["x-llmgw-replica"] == "r1"
        fleet.holds["a"] = asyncio.Event()
        busy = asyncio.create_task(ask(gw, key, "a"))
        await until(lambda: fleet.arrived.count("a") == 2)
        second = asyncio.create_task(ask(gw, key, "a"))
        await until(lambda: fleet.arrived.count("a") == 3)
        assert [(x.replica_id, x.adapter.name) for x in fleet.loads] == [("r1", "a"), ("r2", "a")]
        # Both replicas saturated on a: the next request is told to retry.
        refused = await ask(gw, key, "a")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "replicas_saturated"
        fleet.holds["a"].set()
        answers = [await busy, await second]
        assert [r.headers["x-llmgw-replica"] for r in answers] == ["r1", "r2"]


async def test_adapters_are_listed_and_the_key_allow_list_applies(tmp_path: Path) -> None:
    async with fleet_gateway(tmp_path / "s.db", ["r1"]) as (gw, fleet, key):
        listed = (await gw.http.get("/v1/models", headers=auth(key))).json()["data"]
        assert [m["id"] for m in listed] == ["a", "b", "base", "c", "d"]
        _, only_a = gw.key(models=["a"])
        listed = (await gw.http.get("/v1/models", headers=auth(only_a))).json()["data"]
        assert [m["id"] for m in listed] == ["a"]
        r = await ask(gw, only_a, "b")
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
        assert (await ask(gw, key, "zz")).status_code == 404
        assert not fleet.loads


async def test_a_client_gone_mid_request_releases_its_adapter(tmp_path: Path) -> None:
    async with fleet_gateway(tmp_path / "s.db", ["r1"], max_loaded=1) as (gw, fleet, key):
        fleet.holds["a"] = asyncio.Event()  # the engine "generates" until told
        body = json.dumps({"model": "a", "messages": [{"role": "user", "content": "hi"}]})
        gone = asyncio.Event()
        read: list[bytes] = []

        async def receive() -> dict[str, object]:
            if not read:
                read.append(body.encode())
                return {"type": "http.request", "body": read[0], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            pass

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"authorization", f"Bearer {key}".encode()), (b"host", b"router")],
            "client": ("127.0.0.1", 1),
            "server": ("router", 80),
        }
        answer = asyncio.create_task(gw.app(scope, receive, send))  # type: ignore[arg-type]
        await until(lambda: fleet.arrived == ["a"])
        # a is in flight: the only slot cannot be freed for b.
        busy = await ask(gw, key, "b")
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "replicas_saturated"
        gone.set()
        async with asyncio.timeout(5):
            await answer
        # The client's departure released a: b takes its place.
        assert (await ask(gw, key, "b")).status_code == 200
        assert fleet.loads[-1].evict == "a"
        fleet.holds["a"].set()


async def test_static_adapters_go_to_holders_with_each_replicas_own_llama_cpp_id(
    tmp_path: Path,
) -> None:
    # Two llama.cpp replicas started from different catalog versions: other ids.
    memos = [memo("r1"), memo("r2"), memo("r3")]
    memos[0].adapters, memos[1].adapters = ["x", "y"], ["y", "x"]  # r3 holds none
    llama = ModelSpec(
        name=BASE,
        source="/m.gguf",
        adapters=[AdapterSpec(name=a, source=f"/adapters/{a}.gguf") for a in ("x", "y")],
    )
    async with gateway(tmp_path / "s.db", memos, [llama]) as gw:
        _, key = gw.key()
        for _ in range(4):
            r = await ask(gw, key, "y", cache_prompt=True)
            assert r.status_code == 200
            sent = gw.engine.body()
            want = {"r1": 1, "r2": 0}[r.headers["x-llmgw-replica"]]
            assert sent["lora"] == [{"id": want, "scale": 1.0}]
            assert sent["model"] == "y" and sent["cache_prompt"] is False
        assert {s.url.host for s in gw.engine.seen} == {"r1", "r2"}
        # The base model: a client's own adapter selection is dropped.
        r = await ask(gw, key, BASE, lora=[{"id": 0, "scale": 1.0}])
        assert r.status_code == 200 and "lora" not in gw.engine.body()


async def test_static_vllm_adapters_are_selected_by_the_model_field_as_sent(
    tmp_path: Path,
) -> None:
    memos = [memo("r1"), memo("r2")]
    memos[1].adapters = ["x"]
    vllm = ModelSpec(
        name=BASE,
        engine=EngineKind.VLLM,
        source="/models/base",
        adapters=[AdapterSpec(name="x", source="/adapters/x")],
    )
    async with gateway(tmp_path / "s.db", memos, [vllm]) as gw:
        _, key = gw.key()
        body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(3):
            r = await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
            assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "r2"
            sent = gw.engine.body()
            # The key's cache salt comes along (router/affinity/scope.py), the rest as sent.
            assert len(sent.pop("cache_salt")) == 64 and sent == body
