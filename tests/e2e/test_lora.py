"""LoRA with llama.cpp for real: catalog adapters loaded at start, chosen per request."""

import httpx
from temporalio.client import Client

from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.store import Store
from llmgw.types import AdapterSpec, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System


async def test_static_adapters_are_held_in_catalog_order_and_change_the_output(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(
        name="tiny-lora",
        source=str(tiny.model_path),
        adapters=[
            AdapterSpec(name=name, source=str(path)) for name, path in sorted(tiny.adapters.items())
        ],
    )
    system.spawn("control")
    system.spawn_agent("lora-node")
    await replicas.wait_node_registered(client, "lora-node", 60)
    rid = await replicas.start_replica(client, spec)
    memo = await replicas.wait_ready(client, rid, 120)
    assert (memo.engine, memo.adapters) == ("llama.cpp", ["lora-a", "lora-b"])

    store = Store(system.store_url)
    headers = {"Authorization": f"Bearer {engine_key(store.engine_key_secret(), rid)}"}
    store.close()
    outputs = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for label, lora in (("base", []), ("lora-a", [0]), ("lora-b", [1])):
            body = {
                "prompt": "The quick brown fox",
                "max_tokens": 12,
                "temperature": 0,
                "lora": [{"id": i, "scale": 1.0} for i in lora],
            }
            resp = await http.post(f"{memo.endpoint}/v1/completions", json=body, headers=headers)
            assert resp.status_code == 200, resp.text
            outputs[label] = resp.json()["choices"][0]["text"]
    assert len(set(outputs.values())) == 3, outputs
    await replicas.stop_replica(client, rid, "test done", 60)
