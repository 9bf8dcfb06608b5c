"""``POST /v1/batches`` while the Temporal server is frozen (SIGSTOP).

The router's design (router/api/batches.py, router/control_link/jobs.py):
the batch's row is inserted in the store and answered at once; the start of
its workflow is fired in the background, and a start that fails is left to
the control worker's sweeper (activities/control/jobs_sweeper.py), which
starts every row left unstarted, idempotently (one workflow id per batch).

What a client must see: the create answered in time (the batch, status
``validating``) and the batch readable while Temporal is frozen; once it
resumes (SIGCONT), the batch runs to ``completed`` with one output line per
``custom_id``, under exactly one workflow: never a batch stuck in
``validating`` with no workflow, never two runs of one batch.

Real processes, all on a Temporal dev server of the test's own (frozen): the
control worker, an agent with a llama.cpp replica, the router, driven by
the official openai client.
"""

import contextlib
import io
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.queues import batch_workflow_id
from llmgw.temporal import connect
from llmgw.types import EngineKind, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child, wait_for
from tests.e2e.test_batch_faults import TERMINAL, chat_line, completed, jsonl, until
from tests.harness import System, free_port, start_devserver, wait_routable

M = "tiny-frozen"
LINES = 6
# The client's own bound: a create the router lets hang fails the test.
CLIENT_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def own_temporal(root: Path) -> AsyncIterator[tuple[Child, Client]]:
    """A dev server of the test's own (freezing it disturbs no other test)."""
    port = free_port()
    server = start_devserver(root / "temporal.db", port, root / "temporal.log")
    try:
        yield server, await connect(f"127.0.0.1:{port}")
    finally:
        server.signal(signal.SIGCONT)  # never left frozen
        server.stop()


async def runs_of(client: Client, workflow_id: str) -> int:
    """How many executions the workflow id has had."""
    return len([w async for w in client.list_workflows(f'WorkflowId = "{workflow_id}"')])


@pytest.mark.timeout(900)
async def test_a_batch_created_while_temporal_is_frozen_runs_once_it_resumes(
    tmp_path: Path, tiny: TinyModel
) -> None:
    spec = ModelSpec(
        name=M, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path), context_length=4096,
    )  # fmt: skip
    async with own_temporal(tmp_path) as (server, temporal):
        system = System(server_address(temporal), tmp_path / "llmgw", free_port())
        system.work_dir.mkdir()
        port = free_port()
        system.env.update(
            {"LLMGW_ROUTER_URLS": f"http://127.0.0.1:{port}", "LLMGW_JOB_SWEEP_INTERVAL_S": "1"}
        )
        try:
            key = system.catalog(spec)
            system.spawn("control")
            system.spawn("agent", {"LLMGW_NODE_ID": "frozen-node"})
            router = system.start_router(port)
            await replicas.wait_node_registered(temporal, "frozen-node", 60)
            rid = await replicas.start_replica(temporal, spec)
            await replicas.wait_ready(temporal, rid, 180)
            root = f"http://127.0.0.1:{port}"
            await wait_routable(f"{root}/v1", key, M, 60)
            client = openai.AsyncOpenAI(
                base_url=f"{root}/v1", api_key=key, timeout=CLIENT_TIMEOUT_S, max_retries=0
            )
            async with client:
                made = await client.files.create(
                    file=("in.jsonl", io.BytesIO(jsonl([chat_line(i, M) for i in range(LINES)]))),
                    purpose="batch",
                )
                server.signal(signal.SIGSTOP)
                try:
                    batch = await client.batches.create(
                        input_file_id=made.id, endpoint="/v1/chat/completions",
                        completion_window="24h",
                    )  # fmt: skip
                    assert batch.status == "validating", batch
                    # The router's start of its workflow failed (the frozen
                    # server never answered it): what the sweeper is for.
                    failed_start = f"start batch {batch.id}"
                    assert wait_for(lambda: failed_start in router.log_path.read_text(), 60), (
                        router.log_tail()
                    )
                    # Readable meanwhile, from the store.
                    now = await client.batches.retrieve(batch.id)
                    assert now.status == "validating", now
                finally:
                    server.signal(signal.SIGCONT)
                done = await until(client, batch.id, lambda b: b.status in TERMINAL, 300)
                assert done.status == "completed", (done.errors, logs(system))
                assert completed(done) == LINES
                assert done.output_file_id is not None and done.error_file_id is None
                text = (await client.files.content(done.output_file_id)).text
            out = [json.loads(line) for line in text.splitlines()]
            assert sorted(line["custom_id"] for line in out) == sorted(
                f"line-{i}" for i in range(LINES)
            )
            assert await runs_of(temporal, batch_workflow_id(batch.id)) == 1
            await replicas.stop_replica(temporal, rid, "test over", 30)
        finally:
            system.stop()


def server_address(client: Client) -> str:
    """The address ``client`` was connected to."""
    return client.service_client.config.target_host


def logs(system: System) -> str:
    """The tails of every process's log, for a failure's message."""
    return "\n".join(f"--- {c.name}:\n{c.log_tail(30)}" for c in system.children)
