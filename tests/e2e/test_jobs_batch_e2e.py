"""A batch on the real processes (control worker, agent, llama.cpp replica,
three routers sharing the store), driven by the official openai client:
``files.create``, ``batches.create``, poll, download. While it runs, the
control worker executing it is SIGKILLed (a new one takes over) and then
the router its lines go through; the batch still ends ``completed`` with
exactly one output line per ``custom_id``, each billed exactly once."""

import asyncio
import io
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from sqlmodel import func, select
from temporalio.client import Client

from llmgw import replicas
from llmgw.store import Store
from llmgw.store.openai_tables import BatchResult
from llmgw.types import EngineKind, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from router.api.apikeys import list_keys
from router.billing import usage
from tests.harness import System, free_port, wait_routable

M = "tiny-batch"
LINES = 60


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


@pytest.fixture(scope="module")
async def served(system: System, client: Client, tiny: TinyModel) -> AsyncIterator[dict[str, Any]]:
    """One llama.cpp replica behind three routers; the executor uses B then C."""
    spec = ModelSpec(
        name=M,
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        context_length=2048,
        engine_args=["--parallel", "2"],
    )
    system.catalog(spec)
    port_b, port_c = free_port(), free_port()
    system.env.update(
        {
            "LLMGW_ROUTER_URLS": f"http://127.0.0.1:{port_b},http://127.0.0.1:{port_c}",
            "LLMGW_BATCH_CHUNK_LINES": "5",
            "LLMGW_BATCH_PARALLEL_CHUNKS": "2",
            "LLMGW_BATCH_LINE_CONCURRENCY": "2",
            "LLMGW_JOB_SWEEP_INTERVAL_S": "1",
        }
    )
    started = await system.start(client, "batch-node")
    rid = await replicas.start_replica(client, spec)
    await replicas.wait_ready(client, rid, 120)
    router_b = system.start_router(port_b)
    system.start_router(port_c)
    store = Store(system.store_url)
    key = store.create_api_key("batch")
    key_id = next(k.id for k in list_keys(store) if k.prefix == key[:14])
    for root in (started.root, f"http://127.0.0.1:{port_b}", f"http://127.0.0.1:{port_c}"):
        await wait_routable(f"{root}/v1", key, M)
    yield {"a": started.root, "key": key, "key_id": key_id, "router_b": router_b, "store": store}
    store.close()
    await replicas.stop_replica(client, rid, "test over", 30)


def results(store: Store, batch_id: str) -> int:
    with store.session() as session:
        return int(
            session.exec(
                select(func.count())
                .select_from(BatchResult)
                .where(BatchResult.batch_id == batch_id)
            ).one()
        )


async def until_results(store: Store, batch_id: str, n: int) -> None:
    async with asyncio.timeout(240):
        while results(store, batch_id) < n:
            await asyncio.sleep(0.1)


async def killed(child: Child) -> None:
    child.signal(signal.SIGKILL)
    async with asyncio.timeout(30):
        while child.alive():
            await asyncio.sleep(0.05)


async def test_a_batch_survives_its_control_worker_and_router(
    system: System, served: dict[str, Any]
) -> None:
    store: Store = served["store"]
    body = b"".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": M,
                    "messages": [{"role": "user", "content": f"say {i}"}],
                    "max_tokens": 24,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for i in range(LINES)
    )
    async with openai.AsyncOpenAI(
        base_url=f"{served['a']}/v1", api_key=served["key"], max_retries=2
    ) as client:
        made = await client.files.create(file=("in.jsonl", io.BytesIO(body)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await until_results(store, batch.id, 5)
        control = next(c for c in system.children if c.name == "control" and c.alive())
        await killed(control)  # the worker running the chunks dies
        system.spawn("control")  # another takes over (Temporal retries the chunks)
        await until_results(store, batch.id, 25)
        await killed(served["router_b"])  # the router the lines go through dies
        async with asyncio.timeout(300):
            while (batch := await client.batches.retrieve(batch.id)).status not in (
                "completed", "failed", "expired", "cancelled",
            ):  # fmt: skip
                await asyncio.sleep(0.5)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
        assert batch.output_file_id is not None and batch.error_file_id is None
        text = (await client.files.content(batch.output_file_id)).text
    out = [json.loads(line) for line in text.splitlines()]
    assert sorted(line["custom_id"] for line in out) == sorted(f"line-{i}" for i in range(LINES))
    assert all(line["response"]["status_code"] == 200 for line in out)
    # Billed exactly once per line: the usage rows equal the output's usage.
    prompt = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in out)
    completion = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out)
    async with asyncio.timeout(30):
        while True:
            rows = usage.query(store, key_id=served["key_id"], model=M)
            billed = (
                sum(r.requests for r in rows),
                sum(r.prompt_tokens for r in rows),
                sum(r.completion_tokens for r in rows),
            )
            if billed[0] >= LINES:
                break
            await asyncio.sleep(0.1)
    assert billed == (LINES, prompt, completion)
