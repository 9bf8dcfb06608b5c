"""The durable jobs' activities (task queue ``exec``).

They talk to a router over HTTP with the exec token (every line through the
router's admission queue, at class batch, as the batch's key: interactive
traffic goes first and quotas hold) and to the store directly. A line's
outcome is written in ONE transaction: its ``BatchResult`` (primary key
``(batch_id, custom_id)``), the batch's counters and the key's usage, only
when the insert is new, so a retried chunk, or a line run twice because a
worker died between the answer and the commit, neither counts nor bills
twice (the duplicate compute is real, and not billed).

A router that cannot be reached is left for the next URL of
``LLMGW_ROUTER_URLS``; answers that mean "not now" (429, 503: a full queue,
no replica yet) are retried with backoff, never a line's failure.

This module holds the activities themselves; the work of the larger ones is
beside it: the router client (router_client.py), a chunk's lines
(jobs_chunks.py), the result files (jobs_finalize.py); the sweeper that
starts jobs no router started is jobs_sweeper.py.
"""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.control import jobs_lines as rules
from activities.control.jobs_chunks import CANCEL_GRACE_S, HEARTBEAT_EVERY_S, ChunkRunner
from activities.control.jobs_finalize import Finalizer
from activities.control.router_client import RouterClient
from llmgw import contracts
from llmgw.store import Store
from llmgw.store.openai_tables import BatchRecord, ResponseRecord
from llmgw.types import (
    BatchId,
    BatchLineError,
    BatchState,
    BatchStatus,
    BatchStatusChange,
    BatchValidation,
    ChunkRange,
    ChunkResult,
    FinalizeBatch,
    Finalized,
    ResponseRun,
    ResponseRunResult,
)

log = logging.getLogger(__name__)

# Validate calls a router refuses with 401 before the batch fails on it.
VALIDATE_AUTH_TRIES = 5

_AT_FIELD = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


class JobActivities:
    """The exec queue's activities, built from their dependencies."""

    def __init__(
        self,
        store: Store,
        router: RouterClient,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        cancel_grace_s: float = CANCEL_GRACE_S,
        on_stopping: Callable[[ChunkRange, int], None] | None = None,
    ) -> None:
        self._store = store
        self._router = router
        self._clock = clock
        # ``sleep`` (between a line's tries), the grace and ``on_stopping`` are
        # the chunks' (activities/control/jobs_chunks.py).
        self._chunks = ChunkRunner(store, router, clock, sleep, cancel_grace_s, on_stopping)
        self._finalizer = Finalizer(store)

    # -- validate -------------------------------------------------------------

    @activity.defn(name=contracts.VALIDATE_BATCH.name)
    async def validate_batch(self, arg: BatchId) -> BatchValidation:
        """The router validates the input file and writes the batch's lines,
        as the batch's key (its allow-list decides ``model_not_allowed``)."""
        key_id = await asyncio.to_thread(self._key_of, arg.batch_id)
        if key_id is None:
            return BatchValidation(
                errors=[BatchLineError(code="batch_not_found", message="The batch is gone.")]
            )
        headers = await self._router.headers(key_id)
        try:
            answer = await self._router.post(
                f"/internal/batches/{arg.batch_id}/validate", {}, headers
            )
        except httpx.TransportError as exc:
            raise ApplicationError(f"no router answered: {exc}") from exc
        if answer.status_code >= 500 or answer.status_code == 429:
            raise ApplicationError(f"router answered {answer.status_code} to validate")
        if answer.status_code == 401 and activity.info().attempt < VALIDATE_AUTH_TRIES:
            # The exec token or the key refused: a router that has not read a
            # key made a moment ago, or routers and worker on other secrets
            # for a while. Tried again before the batch fails on it.
            raise ApplicationError("router refused the exec token or the batch's key (401)")
        if answer.status_code >= 400:
            # The batch is gone or another key's: nothing will ever validate it.
            return BatchValidation(
                errors=[BatchLineError(code="batch_not_found", message=answer.text[:500])]
            )
        return BatchValidation.model_validate(answer.json())

    def _key_of(self, batch_id: str) -> int | None:
        with self._store.session() as session:
            row = session.get(BatchRecord, batch_id)
            return row.key_id if row is not None else None

    def _response_key_of(self, response_id: str) -> int | None:
        with self._store.session() as session:
            row = session.get(ResponseRecord, response_id)
            return row.key_id if row is not None else None

    # -- status -----------------------------------------------------------------

    @activity.defn(name=contracts.SET_BATCH_STATUS.name)
    async def set_batch_status(self, arg: BatchStatusChange) -> BatchState:
        """Move the batch (rules.next_status), its ``<status>_at`` set once."""
        return await asyncio.to_thread(self._set_status, arg)

    def _set_status(self, arg: BatchStatusChange) -> BatchState:
        with self._store.session() as session:
            row = session.get(BatchRecord, arg.batch_id)
            if row is None:
                raise ApplicationError(f"no batch {arg.batch_id}", non_retryable=True)
            status = rules.next_status(BatchStatus(row.status), arg.status)
            if status is not BatchStatus(row.status) or status is arg.status:
                row.status = status.value
                at = _AT_FIELD.get(status)
                if at is not None and getattr(row, at) is None:
                    setattr(row, at, int(self._clock()))
                if arg.errors is not None and status is BatchStatus.FAILED:
                    row.errors = [e.model_dump() for e in arg.errors]
                session.add(row)
                session.commit()
                session.refresh(row)
            return BatchState(
                status=BatchStatus(row.status),
                total=row.total,
                completed=row.completed,
                failed=row.failed,
                key_id=row.key_id,
            )

    # -- lines --------------------------------------------------------------

    # -- lines (activities/control/jobs_chunks.py) --------------------------------

    @activity.defn(name=contracts.RUN_CHUNK.name)
    async def run_chunk(self, arg: ChunkRange) -> ChunkResult:
        """Run the range's lines not yet done; on cancellation, start no more
        and let those in flight finish (within CANCEL_GRACE_S) and be recorded."""
        return await self._chunks.run(arg)

    # -- finalize (activities/control/jobs_finalize.py) ---------------------------

    @activity.defn(name=contracts.FINALIZE_BATCH.name)
    async def finalize_batch(self, arg: FinalizeBatch) -> Finalized:
        """Write the output and error files (deterministic ids: a retry
        replaces them) and set them on the batch."""
        return await asyncio.to_thread(self._finalizer.finalize, arg)

    # -- background responses ---------------------------------------------------

    @activity.defn(name=contracts.RUN_RESPONSE.name)
    async def run_response(self, arg: ResponseRun) -> ResponseRunResult:
        """Have a router run (or continue) the stored response; heartbeats per
        event it persisted. A lost connection or a 5xx is retried by Temporal
        (the router continues from the stored events)."""
        key_id = await asyncio.to_thread(self._response_key_of, arg.response_id)
        if key_id is None:
            return ResponseRunResult(status="not_found")
        # The exec token is bound to the response's key: it runs that key's only.
        headers = await self._router.headers(key_id)
        last = ResponseRunResult()
        ticker = asyncio.create_task(self._beat_response(last))
        try:
            async with self._router.stream(
                f"/internal/responses/{arg.response_id}/run", headers
            ) as answer:
                if answer.status_code == 404:
                    return ResponseRunResult(status="not_found")
                if answer.status_code >= 500 or answer.status_code == 429:
                    raise ApplicationError(f"router answered {answer.status_code}")
                if answer.status_code >= 400:
                    text = (await answer.aread()).decode(errors="replace")[:500]
                    raise ApplicationError(
                        f"router refused the response: {answer.status_code} {text}",
                        non_retryable=True,
                    )
                if answer.headers.get("content-type", "").startswith("application/json"):
                    data = json.loads(await answer.aread())
                    return ResponseRunResult(
                        status=str(data.get("status", "")), last_seq=last.last_seq
                    )
                async for raw in answer.aiter_lines():
                    if not raw.startswith("data:"):
                        continue
                    event = _event(raw[5:])
                    if event is None:
                        continue
                    last.last_seq = int(event.get("sequence_number", last.last_seq))
                    response = event.get("response")
                    if isinstance(response, dict) and response.get("status"):
                        last.status = str(response["status"])
                    activity.heartbeat(last.model_dump())
        except httpx.TransportError as exc:
            raise ApplicationError(f"lost the router: {exc}") from exc
        finally:
            ticker.cancel()
        return last

    async def _beat_response(self, last: ResponseRunResult) -> None:
        while True:
            activity.heartbeat(last.model_dump())
            await asyncio.sleep(HEARTBEAT_EVERY_S)


def _event(data: str) -> dict[str, Any] | None:
    try:
        event = json.loads(data)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
