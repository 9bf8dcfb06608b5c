"""The admission queue and the wake in front of a real llama.cpp engine, driven
by the official openai client: the router app served by uvicorn, its routing
table fed by the test (a replica appears when the test says so), the
deployment played by an injected link."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import uvicorn

from llmgw.store import Store
from llmgw.types import AutoscalePolicy, EngineProfile, ModelSpec, QueuePolicy, WakeResult
from llmgw_cli.dev.tinymodel import TinyModel
from router.admission.queue import Admission
from router.api.apikeys import create_key, list_keys
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from router.control_link.routing import RoutingTable
from tests.gateway.test_admission import FakeLink
from tests.gateway_util import FakeSource, ready
from tests.harness import free_port
from tests.llama_servers import llama_servers, store_secret

if TYPE_CHECKING:
    from worker_agent.installs.llamacpp import LlamaCppInstall

M = "tiny-q"
REPLICA = "r-llama"
SECRET_STORE = "s.db"
# llama.cpp generates until told: a request that holds the slot for a while.
LONG = {"ignore_eos": True}
LONG_TOKENS = 1500  # about a second or more on one CPU thread (tiny model)
ADMIN = "admission-admin"


@dataclass
class Engine:
    endpoint: str
    secret: str
    store_url: str


@pytest.fixture(scope="module")
def engine(
    llama: "LlamaCppInstall", tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """One llama.cpp server with one slot, keyed as the router will key it."""
    root = tmp_path_factory.mktemp("admission")
    store_url = f"sqlite:///{root / SECRET_STORE}"
    secret = store_secret(store_url)
    with llama_servers(llama, tiny, root, secret, M, [REPLICA], 2048) as endpoints:
        yield Engine(endpoints[REPLICA], secret, store_url)


def model(max_inflight: int = 1, autoscale: bool = False, **queue: Any) -> ModelSpec:
    return ModelSpec(
        name=M,
        source="/unused.gguf",
        context_length=2048,
        profile=EngineProfile(max_inflight=max_inflight),
        autoscale=AutoscalePolicy(min_replicas=0) if autoscale else None,
        queue=QueuePolicy(**queue),
    )


@dataclass
class Router:
    base: str
    admission: Admission
    source: FakeSource
    store: Store
    link: FakeLink
    table: RoutingTable

    def inflight(self) -> int:
        return sum(r.inflight for r in self.table.routes.get(M, []))

    def waiting(self) -> int:
        return self.admission.waiting(M)

    def key(self, **policy: Any) -> str:
        return create_key(self.store, "k", KeyPolicy(**policy))[1]

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0)

    def replica_up(self, endpoint: str) -> None:
        self.source.items = [ready(REPLICA, M, endpoint)]


@asynccontextmanager
async def router(engine: Engine, spec: ModelSpec, replica: bool = True) -> AsyncIterator[Router]:
    store = Store(engine.store_url)
    store.delete_model(M)
    store.put_model(spec)
    source = FakeSource([ready(REPLICA, M, engine.endpoint)] if replica else [])
    link = FakeLink()
    app = create_app(
        store, source, refresh_interval_s=0.05, usage_flush_interval_s=0.05,
        deployment_link=link, load_report_interval_s=0.1, admin_key=ADMIN,
    )  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as http:
        await until(lambda: server.started)
        while not (await http.get(f"{base}/healthz")).json()["routing_table_loaded"]:
            await asyncio.sleep(0.02)
    try:
        yield Router(base, app.state.deps.admission, source, store, link, app.state.deps.table)
    finally:
        server.should_exit = True
        await task
        store.close()


async def until(cond: Callable[[], bool], timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


async def ask(client: openai.AsyncOpenAI, tokens: int = 8, **extra: Any) -> str:
    resp = await client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=tokens,
        extra_body=extra or None,
    )  # fmt: skip
    return resp.choices[0].message.content or ""


async def hold_the_slot(r: Router, client: openai.AsyncOpenAI) -> "asyncio.Task[str]":
    """A long request in the only slot (the engine generates for a second or more)."""
    task = asyncio.create_task(ask(client, LONG_TOKENS, **LONG))
    await until(lambda: r.inflight() == 1)
    return task


async def metrics(r: Router) -> str:
    async with httpx.AsyncClient() as http:
        return (
            await http.get(f"{r.base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        ).text


async def test_a_saturated_model_queues_and_every_request_succeeds(engine: Engine) -> None:
    async with router(engine, model(max_wait_s=60)) as r, r.client(r.key()) as c:
        tasks = [asyncio.create_task(ask(c, 32, **LONG)) for _ in range(8)]
        await until(lambda: r.waiting() > 0)  # they queue rather than get 503
        answers = await asyncio.gather(*tasks)
        assert all(answers)
        assert r.waiting() == 0 and r.inflight() == 0
        text = await metrics(r)
    waited = next(ln for ln in text.splitlines() if ln.startswith("llmgw_queue_wait_seconds_count"))
    assert float(waited.split()[-1]) >= 1
    assert 'code="503"' not in text and 'status="503"' not in text


async def test_max_waiting_answers_503_with_retry_after(engine: Engine) -> None:
    async with router(engine, model(max_waiting=1)) as r, r.client(r.key()) as c:
        held = await hold_the_slot(r, c)
        queued = asyncio.create_task(ask(c))
        await until(lambda: r.waiting() == 1)
        with pytest.raises(openai.APIStatusError) as refused:
            await ask(c)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.response.json()["error"]["code"] == "queue_full"
        assert await queued and await held


async def test_max_wait_s_answers_503_with_retry_after(engine: Engine) -> None:
    async with router(engine, model(max_wait_s=0.2)) as r, r.client(r.key()) as c:
        held = await hold_the_slot(r, c)
        with pytest.raises(openai.APIStatusError) as late:
            await ask(c)
        assert late.value.status_code == 503
        assert late.value.response.json()["error"]["code"] == "queue_timeout"
        assert int(late.value.response.headers["retry-after"]) >= 1
        assert r.waiting() == 0
        assert await held


async def test_a_client_gone_while_waiting_leaves_the_queue_unbilled(engine: Engine) -> None:
    async with router(engine, model()) as r, r.client(r.key()) as c:
        leaving_key = r.key()
        held = await hold_the_slot(r, c)
        async with r.client(leaving_key) as leaving:
            gone = asyncio.create_task(ask(leaving))
            await until(lambda: r.waiting() == 1)
            gone.cancel()  # the client closes its connection
        await until(lambda: r.waiting() == 0)
        assert 'llmgw_queue_waiting{model="tiny-q"} 0.0' in await metrics(r)
        assert 'llmgw_queue_rejections_total{model="tiny-q",reason="gone"} 1.0' in (
            await metrics(r)
        )
        assert await held
        key_id = next(k.id for k in list_keys(r.store) if k.prefix == leaving_key[:14])
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            rows: list[dict[str, Any]] = []
            async with asyncio.timeout(10):
                while not rows:
                    url = f"{r.base}/admin/usage"
                    rows = (await admin.get(url, params={"key_id": key_id})).json()
                    await asyncio.sleep(0.05)
    [row] = rows
    assert (row["requests"], row["errors"], row["prompt_tokens"], row["completion_tokens"]) == (
        1, 1, 0, 0,
    )  # fmt: skip


async def test_a_flooding_key_does_not_starve_a_light_one(engine: Engine) -> None:
    """Through one slot: a heavy key keeps ten requests waiting, a light key
    one at a time. Served in arrival order the light key would get one request
    in eleven; fair queuing lets it overtake the backlog, so it waits behind
    a request or two (its next one arrives only after its last is answered,
    so the slot goes to a heavy one meanwhile: about 3:1 here)."""
    async with router(engine, model()) as r:
        heavy_key, light_key = r.key(), r.key()
        done = {"heavy": 0, "light": 0}
        stop = asyncio.Event()

        async def loop(client: openai.AsyncOpenAI, name: str) -> None:
            while not stop.is_set():
                await ask(client, 16, **LONG)
                done[name] += 1
                if name == "light" and done["light"] == 10:
                    stop.set()

        async with r.client(heavy_key) as heavy, r.client(light_key) as light:
            flood = [asyncio.create_task(loop(heavy, "heavy")) for _ in range(10)]
            await until(lambda: r.waiting() >= 9)  # the heavy backlog is there first
            await asyncio.wait_for(loop(light, "light"), 120)
            await asyncio.gather(*flood)
    print(f"fairness: heavy served {done['heavy']} while light served {done['light']}")
    # Generous: arrival order would serve about ten heavy per light.
    assert done["heavy"] <= 5 * done["light"], done


async def test_twenty_requests_at_zero_wake_once_and_are_served(engine: Engine) -> None:
    async with router(engine, model(autoscale=True), replica=False) as r, r.client(r.key()) as c:
        listed = (await c.models.list()).data
        assert [(m.id, (m.model_extra or {}).get("llmgw_state")) for m in listed] == [
            (M, "scaled-to-zero")
        ]
        tasks = [asyncio.create_task(ask(c)) for _ in range(20)]
        await until(lambda: r.waiting() == 20 and r.link.answer is not None)
        assert [m for m, _ in r.link.wakes] == [M]
        # The deployment started a replica: the routing table shows it, the wake answers.
        r.replica_up(engine.endpoint)
        assert r.link.answer is not None
        r.link.answer.set_result(WakeResult(ready=True, desired=1))
        assert all(await asyncio.gather(*tasks))
        assert len(r.link.wakes) == 1
        await until(lambda: sum(rep.load.arrivals for _, rep in r.link.reports) == 20)


async def test_a_stream_waiting_for_the_wake_reads_normally(engine: Engine) -> None:
    async with router(engine, model(autoscale=True), replica=False) as r, r.client(r.key()) as c:
        r.admission.stream_quiet_s = 0.0
        r.admission.stream_comment_s = 0.05
        stream = await c.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )  # the 200 came while it waits
        await until(lambda: len(r.link.wakes) == 1)
        asked = time.monotonic()
        await until(lambda: time.monotonic() - asked > 0.2)  # a few comment periods
        r.replica_up(engine.endpoint)
        assert r.link.answer is not None
        r.link.answer.set_result(WakeResult(ready=True, desired=1))
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text


async def test_a_failed_wake_answers_with_its_reason(engine: Engine) -> None:
    async with router(engine, model(autoscale=True), replica=False) as r, r.client(r.key()) as c:
        tasks = [asyncio.create_task(ask(c)) for _ in range(3)]
        await until(lambda: r.waiting() == 3 and r.link.answer is not None)
        assert r.link.answer is not None
        r.link.answer.set_result(WakeResult(ready=False, reason="no node has a free GPU"))
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            assert isinstance(outcome, openai.APIStatusError) and outcome.status_code == 503
            # Why is for admins (tests/gateway/test_error_ids.py); the client has its id.
            assert "free GPU" not in outcome.message and outcome.request_id
            assert outcome.request_id in outcome.message
