"""The gateway in front of real llama.cpp engines, driven by the official openai
client: embeddings, pass-through, hidden stream usage, a client that walks away
mid-stream, the engine-path allow-list, the admin API and ``llmgw keys``."""

import asyncio
import json
import re
import subprocess
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, wait_routable

CHAT = "tiny-gw"
EMBED = "tiny-embed"
ADMIN = "e2e-admin-key"


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


@pytest.fixture(scope="module")
async def served(system: System, client: Client, tiny: TinyModel) -> AsyncIterator[dict[str, str]]:
    """A chat replica and an embeddings replica behind a router."""
    chat = ModelSpec(
        name=CHAT,
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        context_length=2048,  # the tiny model was trained to 2048
        # One slot, and the engine's own counters, to watch it stop generating.
        engine_args=["--parallel", "1", "--metrics"],
    )
    embed = ModelSpec(
        name=EMBED,
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        engine_args=["--embeddings", "--pooling", "mean"],
    )
    key = system.catalog(chat, embed)
    system.env.update(
        {
            "LLMGW_ADMIN_KEY": ADMIN,
            "LLMGW_KEY_CACHE_TTL_S": "0.5",
            "LLMGW_USAGE_FLUSH_INTERVAL_S": "0.1",
        }
    )
    root = (await system.start(client, "gw-node")).root
    ids = [await replicas.start_replica(client, s) for s in (chat, embed)]
    memos = [await replicas.wait_ready(client, rid, 120) for rid in ids]
    await wait_routable(f"{root}/v1", key, CHAT)
    await wait_routable(f"{root}/v1", key, EMBED)
    yield {
        "root": root,
        "base": f"{root}/v1",
        "key": key,
        "chat": ids[0],
        "chat_endpoint": memos[0].endpoint,
    }
    for rid in ids:
        await replicas.stop_replica(client, rid, "test over", 30)


@pytest.fixture
async def oai(served: dict[str, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=served["base"], api_key=served["key"], max_retries=0)
    yield client
    await client.close()


@pytest.fixture
async def admin(served: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=served["root"], headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60
    ) as http:
        yield http


async def _usage(admin: httpx.AsyncClient, key_id: int, model: str) -> dict[str, int]:
    rows = (await admin.get("/admin/usage", params={"key_id": key_id, "model": model})).json()
    return rows[0] if rows else {}


async def _new_key(admin: httpx.AsyncClient, **policy: object) -> tuple[int, str]:
    r = await admin.post("/admin/keys", json={"name": "e2e", "policy": policy})
    assert r.status_code == 201, r.text
    return int(r.json()["id"]), str(r.json()["key"])


async def test_embeddings(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.embeddings.create(model=EMBED, input=["hello", "world"])
    assert len(resp.data) == 2 and len(resp.data[0].embedding) == 64
    assert resp.usage.prompt_tokens > 0


async def test_unknown_fields_pass_through(oai: openai.AsyncOpenAI) -> None:
    # n_probs is llama.cpp's own field: it answers with logprobs only if it got it.
    resp = await oai.completions.create(
        model=CHAT, prompt="hi", max_tokens=2, temperature=0, extra_body={"n_probs": 2}
    )
    assert resp.choices[0].logprobs is not None


async def test_stream_usage_billed_but_not_shown(
    oai: openai.AsyncOpenAI, admin: httpx.AsyncClient, served: dict[str, str]
) -> None:
    key_id, key = await _new_key(admin)
    async with openai.AsyncOpenAI(base_url=served["base"], api_key=key, max_retries=0) as mine:
        stream = await mine.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=7, stream=True
        )
        chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk either
    async with asyncio.timeout(10):
        while not (row := await _usage(admin, key_id, CHAT)):
            await asyncio.sleep(0.05)
    assert row["completion_tokens"] == 7 and row["prompt_tokens"] > 0 and row["requests"] == 1


async def _engine_decoded(http: httpx.AsyncClient, endpoint: str) -> int:
    text = (await http.get(f"{endpoint}/metrics")).text
    match = re.search(r"^llamacpp:n_decode_total (\d+)", text, re.M)
    assert match, text[:500]
    return int(match.group(1))


async def test_client_disconnect_stops_the_engine_and_bills_what_was_sent(
    admin: httpx.AsyncClient, served: dict[str, str]
) -> None:
    key_id, key = await _new_key(admin)
    engine_key = (await admin.get(f"/admin/replicas/{served['chat']}/engine-key")).json()
    endpoint = engine_key["endpoint"]
    async with httpx.AsyncClient(
        headers={"Authorization": f"Bearer {engine_key['engine_key']}"}
    ) as engine:
        before = await _engine_decoded(engine, endpoint)
        async with openai.AsyncOpenAI(base_url=served["base"], api_key=key, max_retries=0) as mine:
            stream = await mine.completions.create(
                model=CHAT, prompt="hi", max_tokens=2000, temperature=0, stream=True
            )
            received = 0
            async for chunk in stream:
                received += bool(chunk.choices and chunk.choices[0].text)
                if received == 5:
                    break
            await stream.close()  # the client walks away
        async with asyncio.timeout(30):
            while (await engine.get(f"{endpoint}/slots")).json()[0]["is_processing"]:
                await asyncio.sleep(0.02)
        decoded = await _engine_decoded(engine, endpoint) - before
    assert decoded < 2000, "the engine generated to the end: the request was not cancelled"
    async with asyncio.timeout(10):
        while not (row := await _usage(admin, key_id, CHAT)):
            await asyncio.sleep(0.05)
    # Billed: what the router relayed, at least what the client read, at most what was made.
    assert 5 <= row["completion_tokens"] <= decoded
    assert row["prompt_tokens"] > 0


@pytest.mark.parametrize(
    "path",
    ["/slots", "/props", "/tokenize", "/lora-adapters", "/v1/load_lora_adapter", "/invocations"],
)
async def test_engine_paths_are_not_routed(served: dict[str, str], path: str) -> None:
    auth = {"Authorization": f"Bearer {served['key']}"}
    auth_admin = {"Authorization": f"Bearer {ADMIN}"}  # /metrics is the admin's
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{served['root']}{path}", json={"model": CHAT}, headers=auth)
        assert r.status_code in (404, 405) and "error" in r.json()
        metrics = await http.get(f"{served['root']}/metrics", headers=auth_admin)
    assert "llmgw_requests_total" in metrics.text
    assert "llamacpp:" not in metrics.text  # the router's own, never the engine's


async def test_admin_api(admin: httpx.AsyncClient, served: dict[str, str]) -> None:
    assert (
        await admin.get("/admin/models", headers={"Authorization": "Bearer x"})
    ).status_code == 401
    reps = {r["replica_id"]: r for r in (await admin.get("/admin/replicas")).json()}
    assert reps[served["chat"]]["phase"] == ReplicaPhase.READY.value
    nodes = (await admin.get("/admin/nodes")).json()
    assert "gw-node" in nodes["nodes"]
    logs = (await admin.get(f"/admin/replicas/{served['chat']}/logs", params={"lines": 500})).json()
    assert any("model loaded" in line for line in logs["lines"])
    models = [m["name"] for m in (await admin.get("/admin/models")).json()]
    assert {CHAT, EMBED} <= set(models)
    assert (await admin.get("/docs")).status_code == 200
    paths = (await admin.get("/openapi.json")).json()["paths"]
    assert {"/v1/embeddings", "/v1/chat/completions", "/admin/keys"} <= set(paths)


def _cli(system: System, *args: str) -> subprocess.CompletedProcess[str]:
    return system.cli(*args, timeout_s=120)


async def test_cli_keys_create_list_revoke(system: System, served: dict[str, str]) -> None:
    made = await asyncio.to_thread(_cli, system, "keys", "create", "cli", "--models", EMBED)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    key_id = re.search(r"key (\d+) \(cli\)", made.stderr)
    assert key.startswith("sk-llmgw-") and key_id
    async with openai.AsyncOpenAI(base_url=served["base"], api_key=key, max_retries=0) as mine:
        assert [m.id for m in (await mine.models.list()).data] == [EMBED]
        with pytest.raises(openai.PermissionDeniedError):
            await mine.completions.create(model=CHAT, prompt="x", max_tokens=1)
        listed = await asyncio.to_thread(_cli, system, "keys", "list")
        assert "cli" in listed.stdout and key not in listed.stdout
        # Widened by another process: the router sees it once its cache entry expires.
        changed = await asyncio.to_thread(
            _cli, system, "keys", "update", key_id.group(1), "--models", f"{EMBED},{CHAT}"
        )
        assert changed.returncode == 0, changed.stderr
        async with asyncio.timeout(10):
            while len((await mine.models.list()).data) != 2:
                await asyncio.sleep(0.05)
        missing = await asyncio.to_thread(_cli, system, "keys", "update", "999", "--rpm", "1")
        assert missing.returncode == 1 and "no key 999" in missing.stderr
        revoked = await asyncio.to_thread(_cli, system, "keys", "revoke", key_id.group(1))
        assert revoked.returncode == 0, revoked.stderr
        # Another process revoked it: the router's cache (0.5 s here) lets it go soon.
        async with asyncio.timeout(10):
            while True:
                try:
                    await mine.models.list()
                except openai.AuthenticationError:
                    break
                await asyncio.sleep(0.05)


async def test_quota_exceeded_is_a_rate_limit_error(
    admin: httpx.AsyncClient, served: dict[str, str]
) -> None:
    # Each call reserves 6 tokens (prompt estimate 5 + max_tokens 1) and uses
    # about 3: the second does not fit in 8, settled or not. A daily budget:
    # no minute boundary can reset it between the calls.
    _, key = await _new_key(admin, token_budget=8)
    async with openai.AsyncOpenAI(base_url=served["base"], api_key=key, max_retries=0) as mine:
        await mine.completions.create(model=CHAT, prompt="x", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as err:
            await mine.completions.create(model=CHAT, prompt="x", max_tokens=1)
    assert err.value.code == "insufficient_quota"
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 86400


async def test_engine_metrics_through_the_admin_api_labelled_by_replica(
    admin: httpx.AsyncClient, served: dict[str, str]
) -> None:
    resp = await admin.get("/admin/engines/metrics")
    assert resp.status_code == 200, resp.text
    lines = resp.text.splitlines()
    label = f'replica="{served["chat"]}",model="{CHAT}"'
    assert any(line.startswith("llamacpp:") and label in line for line in lines), resp.text[:2000]
    assert sum(1 for line in lines if line.startswith("# TYPE llamacpp:prompt_tokens_total")) == 1
    # Only the admin credential opens it; the engines' own /metrics stays unrouted.
    async with httpx.AsyncClient(base_url=served["root"]) as anon:
        assert (await anon.get("/admin/engines/metrics")).status_code == 401
        client_key = {"Authorization": f"Bearer {served['key']}"}
        assert (await anon.get("/admin/engines/metrics", headers=client_key)).status_code in (
            401,
            403,
        )


async def test_bench_straight_at_a_replica_with_its_key_from_the_admin_api(
    system: System, served: dict[str, str]
) -> None:
    run = await asyncio.to_thread(
        _cli, system, "bench", "--model", CHAT, "--url", served["base"], "--replica",
        served["chat"], "--admin-key", ADMIN, "--requests", "6", "--concurrency", "2",
        "--max-tokens", "4", "--prompt-tokens", "4", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["target"] == f"{served['chat_endpoint']}/v1"
    assert (result["requests"], result["errors"]) == (6, 0) and result["output_tokens"] == 24
    assert ADMIN not in run.stdout + run.stderr
