"""The whole spine with real parts: Temporal, control worker, agent with a real
llama.cpp engine, router; the official openai client as the user."""

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.errors import EngineError
from llmgw.queues import replica_workflow_id
from llmgw.store import Store
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase, ReplicaTimeouts
from llmgw_cli.dev.tinymodel import TinyModel
from tests.e2e.openai_calls import streamed_chat
from tests.harness import System, wait_routable
from tests.procs_util import pids_with_args
from tests.recording import record

MODEL = "tiny-e2e"


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


@pytest.fixture(scope="module")
async def served(system: System, client: Client, tiny: TinyModel) -> AsyncIterator[dict[str, str]]:
    """A ready replica behind a running router; yields url, key and replica id."""
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    key = system.catalog(spec)
    base = (await system.start(client, "e2e-node")).base
    replica_id = await replicas.start_replica(client, spec)
    memo = await replicas.wait_ready(client, replica_id, 120)
    await wait_routable(base, key, MODEL)
    yield {"base": base, "key": key, "replica": replica_id, "endpoint": memo.endpoint}
    await replicas.stop_replica(client, replica_id, "test over", 30)


@pytest.fixture
async def oai(served: dict[str, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=served["base"], api_key=served["key"], max_retries=0)
    yield client
    await client.close()


async def test_models_lists_the_ready_model(oai: openai.AsyncOpenAI) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_completion(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens == 8


async def test_completion(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0)
    assert resp.choices[0].text.strip()
    assert resp.usage is not None and resp.usage.completion_tokens == 6


async def test_streamed_chat_with_usage(oai: openai.AsyncOpenAI) -> None:
    text, usage = await streamed_chat(oai, MODEL, max_tokens=8)
    assert text.strip()
    assert usage is not None and usage.completion_tokens == 8


async def test_streamed_completion_matches_unstreamed(oai: openai.AsyncOpenAI) -> None:
    plain = await oai.completions.create(model=MODEL, prompt="river", max_tokens=6, temperature=0)
    stream = await oai.completions.create(
        model=MODEL, prompt="river", max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert streamed == plain.choices[0].text


async def test_unknown_model_is_404(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await oai.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert err.value.code == "model_not_found"


async def test_bad_key_is_401(served: dict[str, str]) -> None:
    async with openai.AsyncOpenAI(
        base_url=served["base"], api_key="sk-llmgw-wrong", max_retries=0
    ) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            await bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert err.value.code == "invalid_api_key"


async def test_bad_body_is_400(served: dict[str, str]) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{served['base']}/chat/completions",
            headers={"Authorization": f"Bearer {served['key']}"},
            json={"model": MODEL},
        )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"


async def test_engine_refuses_requests_without_its_key(served: dict[str, str]) -> None:
    async with httpx.AsyncClient() as http:
        no_key = await http.post(
            f"{served['endpoint']}/v1/completions", json={"prompt": "x", "max_tokens": 1}
        )
        client_key = await http.post(
            f"{served['endpoint']}/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Authorization": f"Bearer {served['key']}"},
        )
    assert no_key.status_code == 401
    assert client_key.status_code == 401


async def test_replica_state_is_searchable(client: Client, served: dict[str, str]) -> None:
    query = f'ReplicaModel="{MODEL}" AND ReplicaState="ready"'
    ids = [wf.id async for wf in client.list_workflows(query)]
    assert ids == [f"replica/{served['replica']}"]
    status = await replicas.status_of(client, served["replica"])
    assert status is not None and status.phase is ReplicaPhase.READY
    assert [h.phase for h in status.history][:4] == [
        ReplicaPhase.FETCHING,
        ReplicaPhase.STARTING,
        ReplicaPhase.LOADING,
        ReplicaPhase.READY,
    ]


def _cli(system: System, *args: str) -> subprocess.CompletedProcess[str]:
    return system.cli(*args)


async def test_cli_deploy_status_stop(system: System, served: dict[str, str]) -> None:
    deployed = await asyncio.to_thread(_cli, system, "deploy", MODEL)
    assert deployed.returncode == 0, deployed.stderr
    match = re.search(rf"started replica ({MODEL}-[0-9a-f]+)", deployed.stderr)
    assert match, deployed.stderr
    new_id = match.group(1)
    assert "ready" in deployed.stderr

    listed = await asyncio.to_thread(_cli, system, "status")
    assert listed.returncode == 0
    rows = {line.split()[1]: line for line in listed.stdout.splitlines() if MODEL in line}
    assert {served["replica"], new_id} <= rows.keys()
    assert "ready" in rows[new_id]

    stopped = await asyncio.to_thread(_cli, system, "stop", new_id)
    assert stopped.returncode == 0, stopped.stderr
    assert f"{new_id}: stopped" in stopped.stderr


async def test_cli_deploy_unknown_model_names_the_catalog(
    system: System, served: dict[str, str]
) -> None:
    result = await asyncio.to_thread(_cli, system, "deploy", "nope")
    assert result.returncode == 1
    assert MODEL in result.stderr and "not in the catalog" in result.stderr


async def test_cli_logs_shows_the_engine_output(system: System, served: dict[str, str]) -> None:
    result = await asyncio.to_thread(_cli, system, "logs", served["replica"], "-n", "200")
    assert result.returncode == 0, result.stderr
    assert "model loaded" in result.stdout
    assert served["key"] not in result.stdout


async def test_a_launch_that_would_leak_a_key_is_refused_before_start(
    client: Client, served: dict[str, str], tiny: TinyModel
) -> None:
    bad = ModelSpec(
        name="tiny-bad-args",
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        engine_args=["--api-key", "visible-in-ps"],
    )
    rid = await replicas.start_replica(client, bad)
    with pytest.raises(EngineError, match="api-key"):
        await replicas.wait_ready(client, rid, 60)
    assert pids_with_args("--alias", "tiny-bad-args") == []


async def test_cli_scale_runs_a_deployment(
    system: System, client: Client, served: dict[str, str]
) -> None:
    up = await asyncio.to_thread(_cli, system, "scale", MODEL, "1")
    assert up.returncode == 0, up.stderr
    assert f"deployment/{MODEL}: 1 replicas desired" in up.stderr
    memo = await replicas.wait_deployment_ready(client, MODEL, 120)
    assert memo.phase is ReplicaPhase.READY and memo.replica_id != served["replica"]
    down = await asyncio.to_thread(_cli, system, "scale", MODEL, "0")
    assert down.returncode == 0, down.stderr
    final = await asyncio.wait_for(client.get_workflow_handle(f"deployment/{MODEL}").result(), 60)
    assert final["desired"] == 0
    await record(client, f"deployment/{MODEL}", "deployment_scale_up_down")
    # What serves the published port is the engine's pass-through, stopped with its group.
    assert pids_with_args(f"--listen 127.0.0.1:{memo.endpoint.rsplit(':', 1)[1]} ") == []


async def test_stop_drains_a_stream_in_flight_before_stopping(
    client: Client, served: dict[str, str], tiny: TinyModel
) -> None:
    spec = ModelSpec(
        name="tiny-drain",
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        context_length=2048,  # the tiny model was trained to 2048
        engine_args=["--parallel", "1"],
    )
    rid = await replicas.start_replica(client, spec, ReplicaTimeouts(router_grace_s=0.5))
    await replicas.wait_ready(client, rid, 120)
    await wait_routable(served["base"], served["key"], "tiny-drain")
    async with openai.AsyncOpenAI(
        base_url=served["base"], api_key=served["key"], max_retries=0
    ) as oai:
        stream = await oai.completions.create(
            model="tiny-drain",
            prompt="hi",
            max_tokens=2000,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = aiter(stream)
        await anext(chunks)  # generation has started
        stopping = asyncio.create_task(replicas.stop_replica(client, rid, "drain test", 120))
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
        stream_done = datetime.now(UTC)
    final = await stopping
    assert usage is not None and usage.completion_tokens == 2000, "the stream was cut"
    assert final.phase is ReplicaPhase.STOPPED
    drained_at = next(h.at for h in final.history if h.phase is ReplicaPhase.DRAINING)
    stopping_at = next(h.at for h in final.history if h.phase is ReplicaPhase.STOPPING)
    assert datetime.fromisoformat(drained_at) < stream_done
    assert datetime.fromisoformat(stopping_at) >= stream_done - timedelta(seconds=1)
    await record(client, replica_workflow_id(rid), "replica_drain_in_flight")


async def test_model_apply_deploys_and_explain_gives_reasons(
    system: System, client: Client, served: dict[str, str], tiny: TinyModel, tmp_path: Path
) -> None:
    catalog = tmp_path / "models.yaml"
    catalog.write_text(
        f"models:\n"
        f"  - name: tiny-cat\n    engine: llama.cpp\n    source: {tiny.model_path}\n"
        f"    replicas: 1\n"
        f"  - name: needs-a-gpu\n    engine: llama.cpp\n    source: {tiny.model_path}\n"
        f"    gpus: 1\n    replicas: 0\n"
    )
    applied = await asyncio.to_thread(_cli, system, "model", "apply", str(catalog), "--deploy")
    assert applied.returncode == 0, applied.stderr
    assert "deployment/tiny-cat: 1 replicas desired" in applied.stderr
    await replicas.wait_deployment_ready(client, "tiny-cat", 120)
    # Earlier tests' replicas have given their slots back (a release lands just
    # after a stop is reported): only this module's replica and tiny-cat's hold one.
    await _until_held(client, "e2e-node", {MODEL, "tiny-cat"})

    placeable = await asyncio.to_thread(_cli, system, "explain", "tiny-cat")
    assert "a new replica would be placed: rank 0 on e2e-node" in placeable.stdout
    # The only live node: a second replica would share it with tiny-cat's
    # first (earlier tests' nodes, deregistered, may be named as the reason).
    assert re.search(
        r"tiny-cat: a new replica would share node e2e-node with tiny-cat-\w+: "
        r"no other node (is registered|fits \(.*agent shut down)",
        placeable.stdout,
    ), placeable.stdout
    refused = await asyncio.to_thread(_cli, system, "explain", "needs-a-gpu")
    assert "needs-a-gpu: no placement" in refused.stdout
    assert "e2e-node: needs 1 free healthy GPUs, has 0" in refused.stdout

    await replicas.remove_deployment(client, ModelSpec(name="tiny-cat", source="x"), 60)


async def _until_held(client: Client, node_id: str, models: set[str]) -> None:
    """Until the allocations on ``node_id`` are one replica of each of ``models``."""
    held: dict[str, str] = {}
    try:
        async with asyncio.timeout(60):
            while True:
                allocations = (await replicas.fleet_snapshot(client)).allocations.values()
                held = {a.replica_id: a.model for a in allocations if a.node_id == node_id}
                if sorted(held.values()) == sorted(models):
                    return
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"{node_id} still holds {held}, not one of each of {models}") from None


def test_bench_prints_a_table_and_valid_json(system: System, served: dict[str, str]) -> None:
    common = ["--model", MODEL, "--requests", "12", "--concurrency", "3", "--max-tokens", "8",
              "--prompt-tokens", "4"]  # fmt: skip
    run = _cli(
        system, "bench", "--url", served["base"], "--api-key", served["key"], *common, "--json"
    )
    assert run.returncode == 0, run.stderr
    gateway = json.loads(run.stdout)
    assert (gateway["requests"], gateway["errors"]) == (12, 0), gateway["first_errors"]
    assert gateway["ttft_p50_ms"] > 0 and gateway["itl_p50_ms"] > 0
    assert gateway["output_tokens"] == 12 * 8 and gateway["requests_per_s"] > 0

    # Straight at the engine with its key: the same figures without the gateway.
    store = Store(system.store_url)
    key = engine_key(store.engine_key_secret(), served["replica"])
    store.close()
    direct = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "bench", "--engine",
         "--url", f"{served['endpoint']}/v1", *common, "--no-stream"],
        env=system.env | {"LLMGW_ENGINE_KEY": key}, capture_output=True, text=True, timeout=180,
        check=False,
    )  # fmt: skip
    assert direct.returncode == 0, direct.stderr
    for measure in ("requests/s", "latency p50 / p99", "TTFT p50 / p99", "output tokens/s"):
        assert measure in direct.stdout
    assert re.search(r"requests \(errors\)\s*│\s*12 \(0\)", direct.stdout), direct.stdout
