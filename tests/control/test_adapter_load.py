"""AdapterLoad against an engine following vLLM's documented runtime-LoRA API.

The engine here is tests/fake_vllm.py (a real HTTP server process started by
the node's supervisor, keyed like a real engine), not vLLM itself: these
tests are about single flight, failures and eviction, and must not wait a
minute for vLLM to start. The workflow and the node activities are the real
ones, on a real Temporal dev server.
"""

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from activities.agent.adapters import AdapterActivities
from llmgw.engine_keys import engine_key
from llmgw.queues import node_queue
from llmgw.types import (
    AdapterLoadInput,
    AdapterLoadResult,
    AdapterSpec,
    EngineKind,
    EngineProfile,
    ModelSpec,
    ReplicaMemo,
    ReplicaPhase,
    ShardRef,
)
from llmgw_cli.procs import wait_for
from router.control_link.adapters import TemporalAdapterLoader
from tests.gateway_util import MockEngine, auth, gateway
from tests.harness import TESTS, free_port, port_open
from worker_agent.adapter_service import AdapterService, busy_adapters
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import Supervisor
from workflows.adapter_load import AdapterLoadWorkflow

SECRET = "adapter-secret"
FAKE = TESTS / "fake_vllm.py"


@dataclass
class Node:
    """A node with one fake-vLLM replica, its activities served in-process."""

    node_id: str
    replica_id: str
    endpoint: str
    queue: str
    adapters: Path

    async def loads(self) -> int:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{self.endpoint}/metrics")).text
        return int(float(text.split("fake_vllm_lora_loads_total ")[1].split()[0]))

    async def held(self) -> list[str]:
        headers = {"Authorization": f"Bearer {engine_key(SECRET, self.replica_id)}"}
        async with httpx.AsyncClient() as http:
            data = (await http.get(f"{self.endpoint}/v1/models", headers=headers)).json()["data"]
        return sorted(m["id"] for m in data if m["parent"])


@pytest.fixture
async def node(client: Client, tmp_path: Path) -> AsyncIterator[Node]:
    suffix = uuid.uuid4().hex[:6]
    node_id, replica_id = f"lora-node-{suffix}", f"lora-base-{suffix}"
    sup = Supervisor(tmp_path / "agent", node_id)
    port = free_port()
    env = dict(os.environ, VLLM_API_KEY=engine_key(SECRET, replica_id))
    argv = [sys.executable, str(FAKE), "serve", "base", "--port", str(port)]
    ref = ShardRef(replica_id=replica_id)
    endpoint = f"http://127.0.0.1:{port}"
    sup.launch(ref, [Command(argv, env)], port, endpoint, ShardRecord(engine="vllm"))
    assert await asyncio.to_thread(wait_for, lambda: port_open(port), 30)
    adapters = tmp_path / "adapters"
    for name in ("sql", "chat", "code", "bad-rank"):
        (adapters / name).mkdir(parents=True)
        rank = 64 if name == "bad-rank" else 8
        (adapters / name / "adapter_config.json").write_text(f'{{"r": {rank}}}')
    queue = f"wf-{suffix}"
    async with (
        httpx.AsyncClient(timeout=30) as http,
        Worker(
            client,
            task_queue=node_queue(node_id),
            activities=[
                (
                    acts := AdapterActivities(
                        AdapterService(sup, lambda r: engine_key(SECRET, r), http, [tmp_path])
                    )
                ).load_adapter,
                acts.unload_adapter,
            ],
        ),
        Worker(client, task_queue=queue, workflows=[AdapterLoadWorkflow]),
    ):
        yield Node(node_id, replica_id, endpoint, queue, adapters)
    sup.stop(ref, grace_s=5)


async def _load(
    client: Client, node: Node, name: str, evict: str | None = None, max_loaded: int = 0
) -> AdapterLoadResult:
    spec = AdapterSpec(name=name, source=str(node.adapters / name))
    result: AdapterLoadResult = await client.execute_workflow(
        AdapterLoadWorkflow.run,
        AdapterLoadInput(
            replica_id=node.replica_id,
            node_id=node.node_id,
            adapter=spec,
            evict=evict,
            max_loaded=max_loaded,
        ),
        id=f"adapter/{node.replica_id}/{name}",
        task_queue=node.queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    return result


def _root(err: BaseException) -> str:
    """The innermost cause's message (workflow failure -> activity -> application)."""
    while (cause := getattr(err, "cause", None)) is not None:
        err = cause
    return str(err)


async def test_fifty_concurrent_requests_for_a_cold_adapter_load_it_once(
    client: Client, node: Node
) -> None:
    results = await asyncio.gather(*(_load(client, node, "sql") for _ in range(50)))
    assert await node.loads() == 1
    assert {r.adapter for r in results} == {"sql"} and any(r.loaded for r in results)
    assert await node.held() == ["sql"]


async def test_a_failed_load_says_why_and_poisons_nothing(client: Client, node: Node) -> None:
    with pytest.raises(WorkflowFailureError) as missing:
        await _load(client, node, "nowhere")
    assert "does not exist on this node" in _root(missing.value)
    with pytest.raises(WorkflowFailureError) as too_big:
        await _load(client, node, "bad-rank")
    assert "greater than max_lora_rank" in _root(too_big.value)
    # The same replica loads the next adapter, and a retry of a failed name runs anew.
    assert (await _load(client, node, "chat")).loaded
    assert await node.held() == ["chat"]


async def test_evict_unloads_the_idle_adapter_first(client: Client, node: Node) -> None:
    await _load(client, node, "sql")
    result = await _load(client, node, "chat", evict="sql")
    assert result.loaded and result.evicted == "sql"
    assert await node.held() == ["chat"]


async def test_an_adapter_another_router_is_using_is_not_unloaded(
    client: Client, node: Node
) -> None:
    """The router that asks knows only its own requests: the engine is asked."""
    await _load(client, node, "sql")
    async with httpx.AsyncClient() as http:
        await http.post(f"{node.endpoint}/fake/running", json={"adapters": ["sql"]})
        with pytest.raises(WorkflowFailureError) as busy:
            await _load(client, node, "chat", evict="sql")
        assert "adapter sql has requests in flight" in _root(busy.value)
        assert await node.held() == ["sql"]
        await http.post(f"{node.endpoint}/fake/running", json={"adapters": []})
    assert (await _load(client, node, "chat", evict="sql")).evicted == "sql"
    assert await node.held() == ["chat"]


async def test_a_full_engine_makes_room_itself_when_the_routers_view_lagged(
    client: Client, node: Node
) -> None:
    """Asked to load with no eviction into a replica already at its cap (another
    router filled it), the node unloads an idle adapter, the oldest loaded
    first, passing over one in use."""
    await _load(client, node, "sql")
    await _load(client, node, "chat")
    async with httpx.AsyncClient() as http:
        await http.post(f"{node.endpoint}/fake/running", json={"adapters": ["sql"]})
        result = await _load(client, node, "code", max_loaded=2)
        assert result.loaded and result.evicted == "chat"
        assert await node.held() == ["code", "sql"]
        # Every adapter in use: refused, nothing changed.
        await http.post(f"{node.endpoint}/fake/running", json={"adapters": ["sql", "code"]})
        with pytest.raises(WorkflowFailureError) as full:
            await _load(client, node, "chat", max_loaded=2)
        assert "none of them idle" in _root(full.value)
        assert await node.held() == ["code", "sql"]


async def test_concurrent_loads_of_different_adapters_keep_the_cap(
    client: Client, node: Node
) -> None:
    """Two routers each see one free place and load different adapters at once:
    the node takes them one at a time, so the second makes room."""
    await _load(client, node, "sql")
    async with httpx.AsyncClient() as http:
        # Long enough for both to list the engine before either load shows.
        await http.post(f"{node.endpoint}/fake/load_delay", json={"seconds": 1.0})
    results = await asyncio.gather(
        _load(client, node, "chat", max_loaded=2), _load(client, node, "code", max_loaded=2)
    )
    assert sorted(r.evicted or "" for r in results) == ["", "sql"]
    assert len(await node.held()) == 2


def test_busy_adapters_are_read_from_the_newest_lora_info_sample() -> None:
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7e+09\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",'
        'waiting_lora_adapters="x"} 1.8e+09\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",'
        'waiting_lora_adapters=""} 1.75e+09\n'
    )
    assert busy_adapters(text) == {"sql", "chat", "x"}
    assert busy_adapters("vllm:num_requests_running 0\n") == set()


class _ToNode(MockEngine):
    """The router's upstream: the node's fake vLLM, under the node's engine key
    (the in-process router's store has a secret of its own)."""

    def __init__(self, node: Node, http: httpx.AsyncClient) -> None:
        super().__init__()
        self.node, self.http = node, http

    async def handle(self, request: httpx.Request) -> httpx.Response:
        key = engine_key(SECRET, self.node.replica_id)
        resp = await self.http.post(
            f"{self.node.endpoint}{request.url.path}",
            content=request.content,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        return httpx.Response(resp.status_code, content=resp.content, headers=resp.headers)


async def test_the_router_loads_through_the_workflow_once_and_reports_failures(
    client: Client, node: Node, tmp_path: Path
) -> None:
    """The router's Temporal loader with the real workflow and node activities."""
    base = ModelSpec(
        name="base",
        engine=EngineKind.VLLM,
        source="/models/base",
        profile=EngineProfile(runtime_lora=True, max_loaded_adapters=2),
        adapters=[
            AdapterSpec(name=n, source=str(node.adapters / n)) for n in ("sql", "chat", "nowhere")
        ],
    )
    memo = ReplicaMemo(
        replica_id=node.replica_id,
        model="base",
        phase=ReplicaPhase.READY,
        node_id=node.node_id,
        endpoint=node.endpoint,
        engine="vllm",
    )
    async with (
        httpx.AsyncClient(timeout=30) as http,
        gateway(
            tmp_path / "s.db",
            [memo],
            [base],
            engine=_ToNode(node, http),
            adapter_loader=TemporalAdapterLoader(client, task_queue=node.queue),
        ) as gw,
    ):
        _, key = gw.key()

        async def ask(model: str) -> httpx.Response:
            body = {"model": model, "prompt": "hi", "max_tokens": 2}
            return await gw.http.post("/v1/completions", json=body, headers=auth(key))

        answers = await asyncio.gather(*(ask("sql") for _ in range(50)))
        assert [r.status_code for r in answers] == [200] * 50, answers[0].text
        assert await node.loads() == 1
        failed = await ask("nowhere")
        assert failed.status_code == 502
        error = failed.json()["error"]
        assert error["code"] == "adapter_load_failed" and "`nowhere`" in error["message"]
        assert "(AdapterNotFound)" in error["message"], error
        assert str(node.adapters) not in error["message"]
        assert (await ask("chat")).status_code == 200
        assert await node.held() == ["chat", "sql"]
