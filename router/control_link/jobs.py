"""Starting and signalling the durable jobs (batches, background responses)
from the router: fire and forget, never on the request's path.

``POST /v1/batches`` and a background ``POST /v1/responses`` insert their row,
answer, and call ``start_batch``/``start_response``: a background task starts
the workflow (``WorkflowType.start_once``: USE_EXISTING, and a duplicate of a
finished one refused: a start is idempotent) within a short RPC timeout and
marks the row started (``llmgw.store.job_rows.mark_started``).
A start that fails (Temporal down, this router killed meanwhile) is only
logged: the control worker's sweeper (activities/control/jobs_sweeper.py) starts
rows left unstarted after a few seconds, and re-sends cancels for batches
still ``cancelling``, so nothing here needs to succeed for the job to run.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Protocol

from temporalio.client import Client

from llmgw import contracts
from llmgw.queues import EXEC_QUEUE, batch_workflow_id, response_workflow_id
from llmgw.store import Store
from llmgw.store.job_rows import mark_started
from llmgw.store.openai_tables import BatchRecord, ResponseRecord
from llmgw.types import BatchRun, CancelJob, ResponseRun

log = logging.getLogger(__name__)

# A start or signal that takes longer is left to the sweeper.
RPC_TIMEOUT = timedelta(seconds=2)


class JobLink(Protocol):
    """What the API handlers call (contract §5); ``Jobs``, or a test's fake."""

    def start_batch(self, batch_id: str) -> None: ...
    def cancel_batch(self, batch_id: str) -> None: ...
    def start_response(self, response_id: str) -> None: ...
    def cancel_response(self, response_id: str) -> None: ...
    async def aclose(self) -> None: ...


def default_jobs(temporal: Client | None, store: Store) -> "Jobs | None":
    """The link through ``temporal``; None without it (the sweeper starts jobs)."""
    return Jobs(lambda: temporal, store) if temporal is not None else None


async def aclose_jobs(jobs: JobLink | None) -> None:
    """At the router's shutdown: drop the starts still under way."""
    if jobs is not None:
        await jobs.aclose()


class Jobs:
    """The router's link to the jobs' workflows (router/app.py builds one)."""

    def __init__(
        self, client: Callable[[], Client | None], store: Store, task_queue: str = EXEC_QUEUE
    ) -> None:
        self._client = client
        self._store = store
        self._queue = task_queue
        self._tasks: set[asyncio.Task[None]] = set()

    def start_batch(self, batch_id: str) -> None:
        """Start the batch's workflow, in the background."""
        self._spawn(f"start batch {batch_id}", lambda c: self._start_batch(c, batch_id))

    def cancel_batch(self, batch_id: str) -> None:
        """Signal the batch's workflow to cancel, in the background."""
        self._spawn(
            f"cancel batch {batch_id}",
            lambda c: contracts.CANCEL_BATCH.send(
                c.get_workflow_handle(batch_workflow_id(batch_id)),
                CancelJob(reason="api"),
                rpc_timeout=RPC_TIMEOUT,
            ),
        )

    def start_response(self, response_id: str) -> None:
        """Start the background response's workflow, in the background."""
        self._spawn(f"start response {response_id}", lambda c: self._start_response(c, response_id))

    def cancel_response(self, response_id: str) -> None:
        """Signal the background response's workflow to cancel, in the background."""
        self._spawn(
            f"cancel response {response_id}",
            lambda c: contracts.CANCEL_RESPONSE.send(
                c.get_workflow_handle(response_workflow_id(response_id)),
                CancelJob(reason="api"),
                rpc_timeout=RPC_TIMEOUT,
            ),
        )

    async def aclose(self) -> None:
        """Stop what is still under way (the sweeper does it instead)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _spawn(self, what: str, call: Callable[[Client], Awaitable[object]]) -> None:
        client = self._client()
        if client is None:
            return  # no Temporal link: the sweeper starts it

        async def run() -> None:
            try:
                await call(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # logged only: the sweeper retries
                log.warning("%s: %s (the control worker's sweeper will)", what, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_batch(self, client: Client, batch_id: str) -> None:
        expires_at = await asyncio.to_thread(self._expires_at, batch_id)
        if expires_at is None:
            return
        run = BatchRun(batch_id=batch_id, expires_at=float(expires_at))
        await contracts.BATCH.start_once(
            client, run, id=batch_workflow_id(batch_id), task_queue=self._queue,
            rpc_timeout=RPC_TIMEOUT,
        )  # fmt: skip
        await asyncio.to_thread(self._mark, BatchRecord, batch_id)

    async def _start_response(self, client: Client, response_id: str) -> None:
        await contracts.RESPONSE.start_once(
            client, ResponseRun(response_id=response_id),
            id=response_workflow_id(response_id), task_queue=self._queue,
            rpc_timeout=RPC_TIMEOUT,
        )  # fmt: skip
        await asyncio.to_thread(self._mark, ResponseRecord, response_id)

    def _expires_at(self, batch_id: str) -> int | None:
        with self._store.session() as session:
            row = session.get(BatchRecord, batch_id)
            return row.expires_at if row is not None else None

    def _mark(self, table: type[BatchRecord | ResponseRecord], row_id: str) -> None:
        mark_started(self._store, table, row_id, int(time.time()))


class FakeJobs:
    """For tests: records what the router asked, starts nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def start_batch(self, batch_id: str) -> None:
        self.calls.append(("start_batch", batch_id))

    def cancel_batch(self, batch_id: str) -> None:
        self.calls.append(("cancel_batch", batch_id))

    def start_response(self, response_id: str) -> None:
        self.calls.append(("start_response", response_id))

    def cancel_response(self, response_id: str) -> None:
        self.calls.append(("cancel_response", response_id))

    async def aclose(self) -> None:
        """Nothing under way."""
