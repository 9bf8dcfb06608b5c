"""Faults of issue 25 §3 on the real processes (control worker, agent,
llama.cpp replica, three routers sharing the store), driven by the official
openai client.

- A 200-line batch survives SIGKILLs of the control worker executing it
  (a new one takes over) and of the router its lines go through (the
  executor goes on through the next of ``LLMGW_ROUTER_URLS``): it ends
  ``completed`` with exactly one output line per ``custom_id``, in OpenAI's
  shape, each billed exactly once.
- A 60-line batch of longer lines, in chunks the kills land in the middle
  of, survives the same two SIGKILLs (a new control worker starts with the
  first router URL again, which is the one killed): ``completed``, one
  output line per ``custom_id``, billed once (tests/e2e/test_jobs_batch_e2e.py
  before it was folded in here).
- Bad input loses nothing: a malformed line fails the batch with the line's
  number in ``errors`` and runs no line; a finished batch's cancel is a 400;
  another key gets 404 for the batch and its files. (An oversized upload's
  413 and a deleted ``previous_response_id``'s 400 are tested in
  tests/gateway/test_files.py and test_responses_api.py.)
- A background response survives a SIGKILLed control worker: it ends with a
  gapless event log, billed once. (The router's SIGKILL, and a resume
  from another router, are in test_responses_e2e.py.)
"""

import asyncio
import io
import json
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
from openai.types import Batch
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
from router.responses import store as rstore
from tests.harness import System, free_port, wait_routable

M = "tiny-faults"
LINES = 200
TERMINAL = ("completed", "failed", "expired", "cancelled")
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def system(module_system: System) -> System:
    return module_system


@pytest.fixture(scope="module")
async def served(system: System, client: Client, tiny: TinyModel) -> AsyncIterator[dict[str, Any]]:
    """One llama.cpp replica behind routers A (the clients'), B and C (the
    executor's, B first)."""
    spec = ModelSpec(
        name=M,
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        context_length=4096,
        engine_args=["--parallel", "2"],
    )
    system.catalog(spec)
    port_b, port_c = free_port(), free_port()
    system.env.update(
        {
            "LLMGW_ROUTER_URLS": f"http://127.0.0.1:{port_b},http://127.0.0.1:{port_c}",
            # Ten chunks: a kill finds chunks half done, and chunks not begun.
            "LLMGW_BATCH_CHUNK_LINES": "20",
            "LLMGW_BATCH_PARALLEL_CHUNKS": "2",
            "LLMGW_BATCH_LINE_CONCURRENCY": "2",
            "LLMGW_JOB_SWEEP_INTERVAL_S": "1",
            "LLMGW_USAGE_FLUSH_INTERVAL_S": "0.1",
        }
    )
    started = await system.start(client, "faults-node")
    rid = await replicas.start_replica(client, spec)
    await replicas.wait_ready(client, rid, 120)
    router_b = system.start_router(port_b)
    system.start_router(port_c)
    store = Store(system.store_url)
    roots = [started.root, f"http://127.0.0.1:{port_b}", f"http://127.0.0.1:{port_c}"]
    probe = store.create_api_key("probe")
    for root in roots:
        await wait_routable(f"{root}/v1", probe, M)
    yield {
        "a": started.root,
        "router_b": router_b,
        "port_b": port_b,
        "probe": probe,
        "store": store,
    }
    store.close()
    await replicas.stop_replica(client, rid, "test over", 30)


def new_key(store: Store, name: str) -> tuple[str, int]:
    key = store.create_api_key(name)
    return key, next(k.id for k in list_keys(store) if k.prefix == key[:14])


def oai(root: str, key: str) -> openai.AsyncOpenAI:
    # Retries: a connection to A may be reset under load; the batch is not.
    return openai.AsyncOpenAI(base_url=f"{root}/v1", api_key=key, max_retries=2)


def chat_line(i: int, model: str = M) -> dict[str, Any]:
    """Batch input line ``i``: a short chat completion of ``model``."""
    return {
        "custom_id": f"line-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"say {i}"}],
            "max_tokens": 6,
        },
    }


def jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    return b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)


def billed(store: Store, key_id: int) -> tuple[int, int, int]:
    """The key's usage rows: requests, prompt and completion tokens."""
    rows = usage.query(store, key_id=key_id, model=M)
    return (
        sum(r.requests for r in rows),
        sum(r.prompt_tokens for r in rows),
        sum(r.completion_tokens for r in rows),
    )


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
    """Wait until ``n`` of the batch's lines have their result stored."""
    async with asyncio.timeout(240):
        while results(store, batch_id) < n:
            await asyncio.sleep(0.1)


async def until(
    client: openai.AsyncOpenAI, batch_id: str, ok: Callable[[Batch], bool], timeout_s: float
) -> Batch:
    """Poll ``batches.retrieve`` until ``ok`` holds for the batch."""
    async with asyncio.timeout(timeout_s):
        while not ok(batch := await client.batches.retrieve(batch_id)):
            await asyncio.sleep(0.2)
    return batch


def completed(batch: Batch) -> int:
    return batch.request_counts.completed if batch.request_counts else 0


def control_worker(system: System) -> Child:
    [control] = [c for c in system.children if c.name == "control" and c.alive()]
    return control


async def killed(child: Child) -> None:
    child.signal(signal.SIGKILL)
    async with asyncio.timeout(30):
        while child.alive():
            await asyncio.sleep(0.05)


@pytest.mark.timeout(900)
async def test_a_200_line_batch_survives_its_control_worker_and_router(
    system: System, served: dict[str, Any]
) -> None:
    store: Store = served["store"]
    key, key_id = new_key(store, "batch")
    before = billed(store, key_id)
    async with oai(served["a"], key) as client:
        made = await client.files.create(
            file=("in.jsonl", io.BytesIO(jsonl([chat_line(i) for i in range(LINES)]))),
            purpose="batch",
        )
        batch = await client.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await until(client, batch.id, lambda b: completed(b) > 40 or b.status in TERMINAL, 300)
        await killed(control_worker(system))  # the worker running the chunks dies
        system.spawn("control")  # another takes over: Temporal retries its chunks
        now = await client.batches.retrieve(batch.id)
        assert now.status not in TERMINAL, f"the batch ended before the kill: {now}"
        await until(client, batch.id, lambda b: completed(b) > 100 or b.status in TERMINAL, 300)
        await killed(served["router_b"])  # the router the lines go through dies
        now = await client.batches.retrieve(batch.id)
        assert now.status not in TERMINAL, f"the batch ended before the kill: {now}"
        batch = await until(client, batch.id, lambda b: b.status in TERMINAL, 600)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert batch.request_counts.model_dump() == {
            "total": LINES,
            "completed": LINES,
            "failed": 0,
        }
        assert batch.output_file_id is not None and batch.error_file_id is None
        assert batch.errors is None
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        text = (await client.files.content(batch.output_file_id)).text
        output = await client.files.retrieve(batch.output_file_id)
        assert output.purpose == "batch_output" and output.bytes == len(text.encode())
    assert results(store, batch.id) == LINES
    out = [json.loads(line) for line in text.splitlines()]
    assert len(out) == LINES
    assert sorted(line["custom_id"] for line in out) == sorted(f"line-{i}" for i in range(LINES))
    assert len({line["id"] for line in out}) == LINES
    assert len({line["response"]["request_id"] for line in out}) == LINES
    for line in out:
        assert set(line) == {"id", "custom_id", "response", "error"}, line
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert set(response) == {"status_code", "request_id", "body"}, line
        assert response["status_code"] == 200 and isinstance(response["request_id"], str)
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == M
        assert body["usage"]["completion_tokens"] >= 1
    # Billed exactly once per line: the key's usage grew by the output's usage.
    prompt = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in out)
    completion = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out)
    after = billed(store, key_id)
    grown = tuple(n - b for n, b in zip(after, before, strict=True))
    assert grown == (LINES, prompt, completion)


@pytest.mark.timeout(900)
async def test_a_batch_survives_its_control_worker_and_router(
    system: System, served: dict[str, Any]
) -> None:
    """60 lines of 24 tokens each; the control worker dies once 5 results are
    stored, router B (the executor's first) once 25 are."""
    store: Store = served["store"]
    if not served["router_b"].alive():  # the 200-line test killed it
        served["router_b"] = system.start_router(served["port_b"])
        await wait_routable(f"http://127.0.0.1:{served['port_b']}/v1", served["probe"], M)
    lines = 60
    key, key_id = new_key(store, "batch-60")
    body = [
        {**line, "body": {**line["body"], "max_tokens": 24, "ignore_eos": True}}
        for line in map(chat_line, range(lines))
    ]
    async with oai(served["a"], key) as client:
        made = await client.files.create(
            file=("in.jsonl", io.BytesIO(jsonl(list(body)))), purpose="batch"
        )
        batch = await client.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await until_results(store, batch.id, 5)
        await killed(control_worker(system))  # the worker running the chunks dies
        system.spawn("control")  # another takes over (Temporal retries the chunks)
        await until_results(store, batch.id, 25)
        await killed(served["router_b"])  # the router the lines go through dies
        batch = await until(client, batch.id, lambda b: b.status in TERMINAL, 300)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (lines, 0)
        assert batch.output_file_id is not None and batch.error_file_id is None
        text = (await client.files.content(batch.output_file_id)).text
    out = [json.loads(line) for line in text.splitlines()]
    assert sorted(line["custom_id"] for line in out) == sorted(f"line-{i}" for i in range(lines))
    assert all(line["response"]["status_code"] == 200 for line in out)
    # Billed exactly once per line: the key's usage rows equal the output's usage.
    prompt = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in out)
    completion = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out)
    async with asyncio.timeout(30):
        while billed(store, key_id)[0] < lines:
            await asyncio.sleep(0.1)
    assert billed(store, key_id) == (lines, prompt, completion)


async def test_bad_input_fails_the_batch_and_loses_nothing(served: dict[str, Any]) -> None:
    """A malformed line: the batch fails with the line's number, no line
    runs or is billed, the input file stays as uploaded; the finished
    batch's cancel is a 400; another key gets 404 for all of it."""
    store: Store = served["store"]
    key, key_id = new_key(store, "bad-input")
    other, _ = new_key(store, "stranger")
    content = jsonl([chat_line(0), "{not json", chat_line(2)])
    async with oai(served["a"], key) as client, oai(served["a"], other) as stranger:
        made = await client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = await until(client, batch.id, lambda b: b.status in TERMINAL, 300)
        assert batch.status == "failed", batch
        assert batch.failed_at is not None
        assert batch.errors is not None and batch.errors.data is not None
        [error] = batch.errors.data
        assert (error.line, error.code) == (2, "invalid_json_line")
        assert error.message
        assert batch.output_file_id is None and batch.error_file_id is None
        # Nothing lost: the input is as uploaded, and still the key's.
        assert (await client.files.content(made.id)).content == content
        # A finished batch cannot be cancelled, and stays as it was.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.batches.cancel(batch.id)
        assert refused.value.body == {
            "message": "Cannot cancel a batch with status 'failed'.",
            "type": "invalid_request_error", "param": None, "code": None,
        }  # fmt: skip
        assert (await client.batches.retrieve(batch.id)).status == "failed"
        # Another key: the batch and the file do not exist.
        for call in (
            stranger.batches.retrieve(batch.id),
            stranger.batches.cancel(batch.id),
            stranger.files.retrieve(made.id),
            stranger.files.content(made.id),
            stranger.files.delete(made.id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        with pytest.raises(openai.NotFoundError):
            await stranger.batches.create(
                input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert (await client.files.retrieve(made.id)).id == made.id
    assert results(store, batch.id) == 0
    assert billed(store, key_id) == (0, 0, 0)


async def _stored_until(
    store: Store, response_id: str, done: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    async with asyncio.timeout(300):
        while not done(events := rstore.events_after(store, response_id, -1)):
            await asyncio.sleep(0.02)
    return events


async def test_a_background_response_survives_its_control_worker(
    system: System, served: dict[str, Any]
) -> None:
    """The control worker whose activity runs the response (through router
    C: B was killed above, or B itself) is SIGKILLed mid-generation; a new
    one retries the activity, which continues the response from its stored
    events (or finds it finished by the router)."""
    store: Store = served["store"]
    key, key_id = new_key(store, "background")
    async with oai(served["a"], key) as client:
        resp = await client.responses.create(
            model=M, input="go", background=True, max_output_tokens=1500
        )
        assert resp.status == "queued"
        await _stored_until(store, resp.id, lambda es: es[-1]["type"].endswith(".delta"))
        await killed(control_worker(system))
        cut = rstore.events_after(store, resp.id, -1)
        assert cut[-1]["type"] not in TERMINAL_EVENTS, "it ended before the kill"
        system.spawn("control")
        events = await _stored_until(store, resp.id, lambda es: es[-1]["type"] in TERMINAL_EVENTS)
        async with asyncio.timeout(60):
            while (final := await client.responses.retrieve(resp.id)).status in (
                "queued", "in_progress",
            ):  # fmt: skip
                await asyncio.sleep(0.1)
        # The whole log, replayed from router A: what was stored, in order.
        replayed = [e async for e in await client.responses.retrieve(resp.id, stream=True)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e.sequence_number for e in replayed] == list(range(len(events)))
    assert [e.type for e in replayed] == [e["type"] for e in events]
    assert final.status in ("completed", "incomplete"), final
    assert len(final.output) == 1
    partial = "".join(e["delta"] for e in cut if e["type"] == "response.output_text.delta")
    assert final.output_text.startswith(partial)
    assert final.usage is not None and final.usage.output_tokens >= 1
    # Billed once, as the whole response.
    async with asyncio.timeout(30):
        while not (rows := usage.query(store, key_id=key_id)):
            await asyncio.sleep(0.05)
    [row] = rows
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (
        1, final.usage.input_tokens, final.usage.output_tokens,
    )  # fmt: skip
