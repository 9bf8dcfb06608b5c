"""The jobs' sweeper: it starts what no router started, re-sends cancels, and
removes file content nobody can read any more (expired files, uploads a
killed router left half-written: llmgw/store/file_upkeep.py).

Split from activities/control/jobs.py (the exec queue's activities): the
sweeper runs in the control worker beside them, on its own timer. A router
starts a job's workflow right after inserting its row (router/control_link/
jobs.py); a start that failed (Temporal down, the router killed meanwhile)
leaves the row unmarked, and the sweeper starts it a few seconds later. Both
start through :meth:`llmgw.contracts.WorkflowType.start_once` and mark the
row with :func:`llmgw.store.job_rows.mark_started`, so a row swept twice,
or one its router did start, is started once.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import timedelta

from sqlmodel import col, select
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import contracts
from llmgw.queues import EXEC_QUEUE, batch_workflow_id, response_workflow_id
from llmgw.store import Store, file_upkeep
from llmgw.store.job_rows import mark_started
from llmgw.store.openai_tables import BatchRecord, ResponseRecord
from llmgw.types import TERMINAL_BATCH, BatchRun, BatchStatus, CancelJob, ResponseRun

# Its log lines keep the logger they had before the split (operators' config).
log = logging.getLogger("activities.control.jobs")

# A row this young may still be started by the router that inserted it.
SWEEP_MIN_AGE_S = 3.0
START_RPC_TIMEOUT = timedelta(seconds=5)
# Files are tidied this often: a scan of the file rows, not of every job.
FILES_INTERVAL_S = 60.0
# A staging row this old is a writer killed mid-way: no live upload of a
# bounded file (LLMGW_MAX_FILE_BYTES) takes six hours to arrive.
ABANDONED_AFTER_S = 6 * 3600.0


class Sweeper:
    """Starts the workflows of batches and background responses that no
    router started (Temporal was down, the router was killed right after the
    insert), and re-sends cancels that may not have arrived. Every start
    uses the row's workflow id and refuses a duplicate, so sweeping a row
    twice, or one its router did start, does nothing."""

    def __init__(
        self,
        store: Store,
        client: Client,
        run_defaults: BatchRun,
        clock: Callable[[], float] = time.time,
        min_age_s: float = SWEEP_MIN_AGE_S,
        task_queue: str = EXEC_QUEUE,
        files_interval_s: float = FILES_INTERVAL_S,
        abandoned_after_s: float = ABANDONED_AFTER_S,
    ) -> None:
        self._store = store
        self._client = client
        self._defaults = run_defaults
        self._queue = task_queue
        self._clock = clock
        self._min_age = min_age_s
        self._files_interval = files_interval_s
        self._abandoned_after = abandoned_after_s

    async def forever(self, interval_s: float) -> None:
        files_due = self._clock()
        while True:
            try:
                await self.once()
            except Exception:  # a sweep that fails is the next one's to do
                log.exception("job sweep failed")
            if self._clock() >= files_due:
                files_due = self._clock() + self._files_interval
                try:
                    await self.tidy_files()
                except Exception:  # the next tidy retries
                    log.exception("file sweep failed")
            await asyncio.sleep(interval_s)

    async def tidy_files(self) -> tuple[int, int]:
        """Delete the content of expired files and what killed writers left;
        (expired, abandoned) files removed."""
        now = int(self._clock())
        expired = 0
        while True:  # a page at a time: short transactions
            page = await asyncio.to_thread(file_upkeep.purge_expired, self._store, now)
            expired += page
            if page < file_upkeep.PURGE_PAGE:
                break
        before = int(now - self._abandoned_after)
        abandoned = await asyncio.to_thread(file_upkeep.purge_abandoned, self._store, before)
        if expired or abandoned:
            log.info("files tidied: %d expired, %d abandoned uploads removed", expired, abandoned)
        return expired, abandoned

    async def once(self) -> int:
        """One pass; how many workflows it started or signalled."""
        before = int(self._clock() - self._min_age)
        batches, responses, cancelling, cancel_responses = await asyncio.to_thread(
            self._due, before
        )
        n = 0
        for batch_id, expires_at in batches:
            await start_batch(self._client, batch_id, expires_at, self._defaults, self._queue)
            await asyncio.to_thread(self._mark, BatchRecord, batch_id)
            n += 1
        for response_id in responses:
            await start_response(self._client, response_id, self._queue)
            await asyncio.to_thread(self._mark, ResponseRecord, response_id)
            n += 1
        for batch_id in cancelling:
            n += await _signal(self._client, batch_workflow_id(batch_id), contracts.CANCEL_BATCH)
        for response_id in cancel_responses:
            n += await _signal(
                self._client, response_workflow_id(response_id), contracts.CANCEL_RESPONSE
            )
        return n

    def _due(self, before: int) -> tuple[list[tuple[str, int]], list[str], list[str], list[str]]:
        with self._store.session() as session:
            batches = session.exec(
                select(BatchRecord.id, BatchRecord.expires_at).where(
                    col(BatchRecord.started_at).is_(None),
                    col(BatchRecord.created_at) <= before,
                    col(BatchRecord.status).not_in([s.value for s in TERMINAL_BATCH]),
                )
            ).all()
            responses = session.exec(
                select(ResponseRecord.id).where(
                    col(ResponseRecord.background).is_(True),
                    col(ResponseRecord.started_at).is_(None),
                    col(ResponseRecord.created_at) <= before,
                    col(ResponseRecord.status).in_(["queued", "in_progress"]),
                )
            ).all()
            cancelling = session.exec(
                select(BatchRecord.id).where(
                    BatchRecord.status == BatchStatus.CANCELLING.value,
                    col(BatchRecord.cancelling_at) <= before,
                )
            ).all()
            cancel_responses = session.exec(
                select(ResponseRecord.id).where(
                    col(ResponseRecord.background).is_(True),
                    col(ResponseRecord.cancel_requested_at) <= before,
                    col(ResponseRecord.status).in_(["queued", "in_progress"]),
                )
            ).all()
        return (
            [(b, int(e)) for b, e in batches],
            list(responses),
            list(cancelling),
            list(cancel_responses),
        )

    def _mark(self, table: type[BatchRecord | ResponseRecord], row_id: str) -> None:
        mark_started(self._store, table, row_id, int(self._clock()))


async def start_batch(
    client: Client, batch_id: str, expires_at: float, defaults: BatchRun, task_queue: str
) -> None:
    """Start a batch's workflow unless it runs or ran already."""
    run = defaults.model_copy(update={"batch_id": batch_id, "expires_at": float(expires_at)})
    await contracts.BATCH.start_once(
        client, run, id=batch_workflow_id(batch_id), task_queue=task_queue,
        rpc_timeout=START_RPC_TIMEOUT,
    )  # fmt: skip


async def start_response(client: Client, response_id: str, task_queue: str) -> None:
    """Start a background response's workflow unless it runs or ran already."""
    await contracts.RESPONSE.start_once(
        client, ResponseRun(response_id=response_id), id=response_workflow_id(response_id),
        task_queue=task_queue, rpc_timeout=START_RPC_TIMEOUT,
    )  # fmt: skip


async def _signal(client: Client, workflow_id: str, signal: contracts.Signal[CancelJob]) -> int:
    try:
        await signal.send(
            client.get_workflow_handle(workflow_id), CancelJob(reason="sweeper"),
            rpc_timeout=START_RPC_TIMEOUT,
        )  # fmt: skip
    except RPCError:
        return 0  # ended already (or never started: the start above runs it)
    return 1
