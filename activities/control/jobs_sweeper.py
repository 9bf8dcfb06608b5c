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

Every store call is waited for within ``store_wait_s``: a query on a frozen
PostgreSQL blocks with no timeout of its own, and the sweeper would say
nothing and do nothing until it answered. Past the bound the pass ends with
a warning and the next one retries (tests/control/test_sweeper_store_frozen.py).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

from sqlmodel import col, select
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import contracts
from llmgw.errors import StoreError
from llmgw.queues import EXEC_QUEUE, batch_workflow_id, response_workflow_id
from llmgw.store import Store, file_upkeep
from llmgw.store.job_rows import mark_started
from llmgw.store.openai_tables import BatchRecord, ResponseRecord
from llmgw.types import TERMINAL_BATCH, BatchRun, BatchStatus, CancelJob, ResponseRun

T = TypeVar("T")

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
# The longest a pass waits for one store call (a frozen store never answers).
STORE_WAIT_S = 30.0


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
        store_wait_s: float = STORE_WAIT_S,
    ) -> None:
        self._store = store
        self._client = client
        self._defaults = run_defaults
        self._queue = task_queue
        self._clock = clock
        self._min_age = min_age_s
        self._files_interval = files_interval_s
        self._abandoned_after = abandoned_after_s
        self._wait = store_wait_s
        # A call given up on, still waiting for the store in its thread.
        self._stuck: asyncio.Future[Any] | None = None

    async def forever(self, interval_s: float) -> None:
        files_due = self._clock()
        while True:
            try:
                await self.once()
            except StoreError as exc:  # the store is down: the next sweep retries
                log.warning("job sweep failed: %s", exc)
            except Exception:  # a sweep that fails is the next one's to do
                log.exception("job sweep failed")
            if self._clock() >= files_due:
                files_due = self._clock() + self._files_interval
                try:
                    await self.tidy_files()
                except StoreError as exc:
                    log.warning("file sweep failed: %s", exc)
                except Exception:  # the next tidy retries
                    log.exception("file sweep failed")
            await asyncio.sleep(interval_s)

    async def tidy_files(self) -> tuple[int, int]:
        """Delete the content of expired files and what killed writers left;
        (expired, abandoned) files removed."""
        now = int(self._clock())
        expired = 0
        while True:  # a page at a time: short transactions
            page = await self._call(lambda: file_upkeep.purge_expired(self._store, now))
            expired += page
            if page < file_upkeep.PURGE_PAGE:
                break
        before = int(now - self._abandoned_after)
        abandoned = await self._call(lambda: file_upkeep.purge_abandoned(self._store, before))
        if expired or abandoned:
            log.info("files tidied: %d expired, %d abandoned uploads removed", expired, abandoned)
        return expired, abandoned

    async def once(self) -> int:
        """One pass; how many workflows it started or signalled."""
        before = int(self._clock() - self._min_age)
        batches, responses, cancelling, cancel_responses = await self._call(
            lambda: self._due(before)
        )
        n = 0
        for batch_id, expires_at in batches:
            await start_batch(self._client, batch_id, expires_at, self._defaults, self._queue)
            await self._call(partial(self._mark, BatchRecord, batch_id))
            n += 1
        for response_id in responses:
            await start_response(self._client, response_id, self._queue)
            await self._call(partial(self._mark, ResponseRecord, response_id))
            n += 1
        for batch_id in cancelling:
            n += await _signal(self._client, batch_workflow_id(batch_id), contracts.CANCEL_BATCH)
        for response_id in cancel_responses:
            n += await _signal(
                self._client, response_workflow_id(response_id), contracts.CANCEL_RESPONSE
            )
        return n

    async def _call(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a thread, waited for at most ``store_wait_s``; past it,
        StoreError. The call given up on keeps its thread until the store
        answers, and the next call waits for it first: a frozen store holds
        one thread and one connection of the worker, not one per pass."""
        if self._stuck is not None:
            await asyncio.wait([self._stuck], timeout=self._wait)
            if not self._stuck.done():
                raise StoreError(f"the store did not answer within {self._wait:g} s")
            self._stuck = None
        work = asyncio.ensure_future(asyncio.to_thread(fn))
        work.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout(self._wait):
                return await asyncio.shield(work)
        except TimeoutError:
            self._stuck = work
            raise StoreError(f"the store did not answer within {self._wait:g} s") from None

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


def _retrieve(work: "asyncio.Future[Any]") -> None:
    # A call given up on may fail once the store answers: nobody's to raise.
    if not work.cancelled():
        work.exception()


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
