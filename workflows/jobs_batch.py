"""Batch: one batch of ``/v1/batches``, workflow id ``batch/<id>``, queue ``exec``.

Validate (the router checks every line and copies them to the store), then
run the lines in chunks: ``parallel_chunks`` RUN_CHUNK activities at a time
over ranges of ``chunk_lines`` lines, each heartbeating its progress (never
one activity per line: history stays small whatever the batch's size). Line
results live in the store, never in the history; a chunk retried after a
worker's death skips the lines recorded already.

The chunks race the completion window (a durable timer to ``expires_at``)
and the CANCEL_BATCH signal: either cancels the running chunks, which start
no more lines and let the ones in flight finish and be recorded
(WAIT_CANCELLATION_COMPLETED), then FINALIZE_BATCH writes the output and
error files (lines that never ran: ``batch_expired``/``batch_cancelled``).
Past ``max_chunks_per_run`` chunks, or when Temporal suggests it, the run
continues as new from the first line not yet scheduled (the same input model
throughout). Progress is upserted to the memo ``batch`` after every chunk,
the status to the search attribute ``BatchStatus``.
"""

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw import search_attributes as sa
    from llmgw.types import (
        TERMINAL_BATCH,
        BatchId,
        BatchLineError,
        BatchMemo,
        BatchRun,
        BatchRunResult,
        BatchState,
        BatchStatus,
        BatchStatusChange,
        CancelJob,
        ChunkRange,
        ChunkResult,
        FinalizeBatch,
    )
    from workflows import jobs_rules as rules

# Store and router calls: retried until they work (a router or the store
# down for a while only delays the batch).
RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))
# A chunk's lines heartbeat at least every 2 s (activities/control/jobs_chunks.py).
CHUNK_HEARTBEAT = timedelta(seconds=10)
CHUNK_TIMEOUT = timedelta(hours=6)
SHORT = timedelta(seconds=30)
LONG = timedelta(hours=1)


@workflow.defn(name=contracts.BATCH.name)
class BatchWorkflow:
    """Validate, run the lines in chunks, finalize."""

    def __init__(self) -> None:
        self._cancel = False
        self._completed = 0
        self._failed = 0

    @workflow.signal(name=contracts.CANCEL_BATCH.name)
    def cancel(self, _: CancelJob) -> None:
        """The router's cancel (fire and forget; the sweeper re-sends)."""
        self._cancel = True

    @workflow.run
    async def run(self, run: BatchRun) -> BatchRunResult:
        """Run the batch ``run.batch_id`` to its end."""
        self._cancel = self._cancel or run.cancelled
        self._completed, self._failed = run.completed, run.failed
        if not run.validated:
            validation = await contracts.VALIDATE_BATCH.run(
                BatchId(batch_id=run.batch_id), start_to_close_timeout=LONG, retry_policy=RETRY
            )
            if validation.errors:
                state = await self._status(run, BatchStatus.FAILED, validation.errors)
                return BatchRunResult(status=state.status)
            state = await self._status(run, BatchStatus.IN_PROGRESS)
            if state.status in TERMINAL_BATCH:
                return BatchRunResult(status=state.status)
            self._cancel = self._cancel or state.status is BatchStatus.CANCELLING
            run = run.model_copy(update={"validated": True, "total": validation.total})
        run, end = await self._lines(run)
        if end is rules.Ending.CONTINUE:
            workflow.continue_as_new(run)
        return await self._finish(run, end)

    async def _lines(self, run: BatchRun) -> tuple[BatchRun, rules.Ending]:
        """Schedule chunks until the lines are done, a cancel, the timer, or
        the run's share of history is used."""
        left = rules.seconds_left(run.expires_at, workflow.now().timestamp())
        timer: asyncio.Task[Any] = asyncio.create_task(workflow.sleep(max(left, 0.001)))
        cancel: asyncio.Task[Any] = asyncio.create_task(
            workflow.wait_condition(lambda: self._cancel)
        )
        running: dict[asyncio.Task[ChunkResult], tuple[int, int]] = {}
        chunks_done = 0
        next_line = run.next_line
        expired = left <= 0
        try:
            while not (self._cancel or expired):
                suggested = workflow.info().is_continue_as_new_suggested()
                if rules.may_schedule(chunks_done, len(running), run.max_chunks_per_run, suggested):
                    free = run.parallel_chunks - len(running)
                    for first, last in rules.next_ranges(
                        next_line, run.total, run.chunk_lines, free
                    ):
                        running[self._chunk(run, first, last)] = (first, last)
                        next_line = last + 1
                if not running:
                    break
                await workflow.wait([*running, timer, cancel], return_when=asyncio.FIRST_COMPLETED)
                for task in [t for t in running if t.done()]:
                    del running[task]
                    self._count(task.result())
                    chunks_done += 1
                self._memo(run, BatchStatus.IN_PROGRESS)
                expired = timer.done()
            if running:
                # Cancelled or expired: the chunks finish their lines in flight.
                for task in running:
                    task.cancel()
                await workflow.wait(list(running))
                for task in running:
                    if not task.cancelled() and task.exception() is None:
                        self._count(task.result())
        finally:
            timer.cancel()
            cancel.cancel()
        run = run.model_copy(
            update={
                "next_line": next_line,
                "cancelled": self._cancel,
                "completed": self._completed,
                "failed": self._failed,
            }
        )
        return run, rules.ending(next_line, run.total, self._cancel, expired)

    def _chunk(self, run: BatchRun, first: int, last: int) -> "asyncio.Task[ChunkResult]":
        return workflow.start_activity(
            contracts.RUN_CHUNK.name,
            ChunkRange(
                batch_id=run.batch_id,
                first_line=first,
                last_line=last,
                line_concurrency=run.line_concurrency,
            ),
            result_type=ChunkResult,
            start_to_close_timeout=CHUNK_TIMEOUT,
            heartbeat_timeout=CHUNK_HEARTBEAT,
            retry_policy=RETRY,
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )

    def _count(self, result: ChunkResult) -> None:
        self._completed += result.completed
        self._failed += result.failed

    async def _finish(self, run: BatchRun, end: rules.Ending) -> BatchRunResult:
        before, never_ran, final = rules.FINISH[end]
        if before is not None:
            await self._status(run, before)
        await contracts.FINALIZE_BATCH.run(
            FinalizeBatch(batch_id=run.batch_id, never_ran_code=never_ran),
            start_to_close_timeout=LONG,
            retry_policy=RETRY,
        )
        state = await self._status(run, final)
        return BatchRunResult(status=state.status, completed=state.completed, failed=state.failed)

    async def _status(
        self, run: BatchRun, status: BatchStatus, errors: list[BatchLineError] | None = None
    ) -> BatchState:
        state = await contracts.SET_BATCH_STATUS.run(
            BatchStatusChange(batch_id=run.batch_id, status=status, errors=errors),
            start_to_close_timeout=SHORT,
            retry_policy=RETRY,
        )
        self._completed = max(self._completed, state.completed)
        self._failed = max(self._failed, state.failed)
        self._memo(run, state.status, state.key_id, state.total)
        return state

    def _memo(self, run: BatchRun, status: BatchStatus, key_id: int = 0, total: int = 0) -> None:
        memo = BatchMemo(
            status=status.value,
            total=total or run.total,
            completed=self._completed,
            failed=self._failed,
            key_id=key_id,
        )
        workflow.upsert_memo(contracts.BATCH_MEMO.encode(memo))
        workflow.upsert_search_attributes([sa.BATCH_STATUS.value_set(status.value)])
