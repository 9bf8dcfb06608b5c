"""A forged Replica (issue 23 item 5): anyone who can write to Temporal can
start a workflow whose memo looks like a ready replica, with an endpoint on a
registered node's address (under ``llmgw up``, the engine user can). The
router must send it neither a request nor a key; the real replica still serves.

Real processes (dev server, control worker, agent, router, llama.cpp); the
forged workflows are started through the Temporal client on a task queue no
worker polls, and a small HTTP server on loopback records what reaches them.
"""

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from llmgw import contracts, replicas
from llmgw import search_attributes as sa
from llmgw.engine_keys import engine_key
from llmgw.queues import replica_workflow_id
from llmgw.store import Store
from llmgw.types import EngineKind, ModelSpec, ReplicaMemo, ReplicaPhase
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System

MODEL = "tiny-forged"
LONE = "tiny-forged-only"  # a model only a forged replica claims to serve
NODE = "forged-node"
ANSWER = (
    b'{"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices":'
    b' [{"index": 0, "message": {"role": "assistant", "content": "forged"},'
    b' "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1,'
    b' "total_tokens": 2}}'
)


@dataclass
class Recorder:
    """What reached the forged endpoint: each request's head and body."""

    port: int = 0
    requests: list[bytes] = field(default_factory=list)


@contextlib.asynccontextmanager
async def forged_endpoint() -> AsyncIterator[Recorder]:
    """An HTTP server on loopback that answers anything 200, recording it."""
    seen = Recorder()

    async def on_connection(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                body = await r.readexactly(int(length.group(1))) if length else b""
                seen.requests.append(head + body)
                w.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER
                )
                await w.drain()
        w.close()

    srv = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    seen.port = srv.sockets[0].getsockname()[1]
    try:
        yield seen
    finally:
        srv.close()


async def _forge(
    client: Client, workflow_rid: str, memo: ReplicaMemo
) -> WorkflowHandle[object, object]:
    """A running ``Replica`` workflow, on a queue nobody polls, publishing ``memo``."""
    return await client.start_workflow(
        contracts.REPLICA.name,
        id=replica_workflow_id(workflow_rid),
        task_queue=f"forged-{uuid.uuid4().hex[:8]}",
        memo=contracts.REPLICA_MEMO.encode(memo),
        search_attributes=TypedSearchAttributes(
            [SearchAttributePair(sa.REPLICA_UPDATED_AT, datetime.now(UTC))]
        ),
    )


async def _chat(http: httpx.AsyncClient, base: str, key: str, model: str) -> int:
    r = await http.post(
        f"{base}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    return r.status_code


async def test_a_forged_replica_on_a_registered_node_gets_no_request_and_no_key(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    key = system.catalog(spec)
    started = await system.start(client, NODE)
    await replicas.apply_deployment(client, spec, 1)
    real = await replicas.wait_deployment_ready(client, MODEL, 180)
    assert real.endpoint.startswith("http://127.0.0.1:")  # the node's registered address

    async with forged_endpoint() as fake:
        endpoint = f"http://127.0.0.1:{fake.port}"
        forged_rid = f"forged-{uuid.uuid4().hex[:8]}"
        forged = [
            # A replica of its own, of the real model and of one nobody serves.
            await _forge(
                client,
                forged_rid,
                ReplicaMemo(
                    replica_id=forged_rid,
                    model=MODEL,
                    phase=ReplicaPhase.READY,
                    node_id=NODE,
                    endpoint=endpoint,
                ),
            ),
            await _forge(
                client,
                f"{forged_rid}-lone",
                ReplicaMemo(
                    replica_id=f"{forged_rid}-lone",
                    model=LONE,
                    phase=ReplicaPhase.READY,
                    node_id=NODE,
                    endpoint=endpoint,
                ),
            ),
            # The real replica's id under another workflow: its key is the prize.
            await _forge(
                client,
                f"{real.replica_id}-twin",
                real.model_copy(update={"endpoint": endpoint}),
            ),
        ]
        try:
            router_log = system.children[-1].log_path
            assert "router" in router_log.name

            async def seen_by_router(http: httpx.AsyncClient) -> bool:
                text = router_log.read_text(errors="replace")
                proved = f"replica {forged_rid}-lone not routed" in text
                twin = f"workflow replica/{real.replica_id}-twin ignored" in text
                r = await http.get(
                    f"{started.base}/models", headers={"Authorization": f"Bearer {key}"}
                )
                routed = LONE in [m["id"] for m in r.json()["data"]]  # before the fix
                return (proved and twin) or routed

            async with httpx.AsyncClient(timeout=60) as http:
                # The router saw them: refused them, or (before the fix) routes to them.
                async with asyncio.timeout(60):
                    while not await seen_by_router(http):
                        await asyncio.sleep(0.1)
                served = [await _chat(http, started.base, key, MODEL) for _ in range(12)]
                lone = await _chat(http, started.base, key, LONE)
            leaked = [r for r in fake.requests if not r.startswith(b"GET /_llmgw/endpoint-proof?")]
            assert leaked == [], leaked[:1]
            assert served == [200] * 12
            assert lone in (404, 503), lone
            everything = b"".join(fake.requests)
            store = Store(system.store_url)
            secret = store.engine_key_secret()
            store.close()
            for rid in (forged_rid, f"{forged_rid}-lone", real.replica_id):
                assert engine_key(secret, rid).encode() not in everything
            assert b"authorization" not in everything.lower()
        finally:
            for handle in forged:
                await handle.terminate("test over")
    await replicas.remove_deployment(client, spec, 60)
