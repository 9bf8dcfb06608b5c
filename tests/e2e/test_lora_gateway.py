"""Static LoRA adapters through the router, for real: Temporal, control worker,
agent, llama.cpp with the tiny model's two adapters, the router; the official
``openai`` client addresses each adapter as the model."""

import httpx
import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.store import Store
from llmgw.types import AdapterSpec, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from tests.harness import System, wait_routable

BASE = "tiny-lora-gw"
PROMPT = "The quick brown fox"


async def _direct(endpoint: str, key: str, lora: list[int]) -> str:
    """The engine's own answer with llama.cpp's per-request adapter ids."""
    body = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "lora": [{"id": i, "scale": 1.0} for i in lora],
        # This llama.cpp reuses a prompt's cache across adapters (wrong output).
        "cache_prompt": False,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(
            f"{endpoint}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    assert resp.status_code == 200, resp.text
    text: str = resp.json()["choices"][0]["text"]
    return text


async def test_adapters_are_addressed_as_models_through_the_router(
    system: System, client: Client, tiny: TinyModel
) -> None:
    # Catalog order b, a: the engine's ids follow it, not the names.
    spec = ModelSpec(
        name=BASE,
        source=str(tiny.model_path),
        adapters=[
            AdapterSpec(name=name, source=str(tiny.adapters[name])) for name in ("lora-b", "lora-a")
        ],
    )
    key = system.catalog(spec)
    store = Store(system.store_url)
    _, base_only = create_key(store, "base-only", KeyPolicy(models=[BASE]))
    started = await system.start(client, "lora-gw-node", own_ports=True)
    rid = await replicas.start_replica(client, spec)
    memo = await replicas.wait_ready(client, rid, 120)
    assert memo.adapters == ["lora-b", "lora-a"]
    secret = engine_key(store.engine_key_secret(), rid)
    store.close()
    base_url = started.base
    await wait_routable(base_url, key, "lora-a")

    expected = {
        BASE: await _direct(memo.endpoint, secret, []),
        "lora-b": await _direct(memo.endpoint, secret, [0]),
        "lora-a": await _direct(memo.endpoint, secret, [1]),
    }
    assert len(set(expected.values())) == 3, expected

    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as oai:
        listed = sorted(m.id for m in (await oai.models.list()).data)
        assert listed == sorted([BASE, "lora-a", "lora-b"])
        # One prompt for all: answers equal the fresh ones only if no cached
        # prompt computed under another adapter is reused (the router turns
        # llama.cpp's prompt cache off for models with adapters).
        got = {}
        for model in expected:
            resp = await oai.completions.create(
                model=model, prompt=PROMPT, max_tokens=12, temperature=0
            )
            got[model] = resp.choices[0].text
        assert got == expected
        stream = await oai.completions.create(
            model="lora-a", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == got["lora-a"]

    async with openai.AsyncOpenAI(base_url=base_url, api_key=base_only, max_retries=0) as oai:
        assert [m.id for m in (await oai.models.list()).data] == [BASE]
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await oai.completions.create(model="lora-a", prompt=PROMPT, max_tokens=4)
        assert denied.value.code == "model_not_allowed"
        # Nor through llama.cpp's own per-request field: the router drops it.
        resp = await oai.completions.create(
            model=BASE,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"lora": [{"id": 1, "scale": 1.0}]},
        )
        assert resp.choices[0].text == expected[BASE]
    await replicas.stop_replica(client, rid, "test done", 60)
