"""One chunk of a batch's lines, run through a router (the ``run_chunk`` activity).

Split from activities/control/jobs.py, whose activity delegates here. Every
line goes through the router's admission queue, at class batch, as the
batch's key; a line's outcome is written in ONE transaction: its
``BatchResult`` (primary key ``(batch_id, custom_id)``), the batch's counters
and the key's usage, only when the insert is new, so a retried chunk, or a
line run twice because a worker died between the answer and the commit,
neither counts nor bills twice. Answers that mean "not now" (429, 503, no
router) are retried with backoff, never a line's failure.
"""

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import and_, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.control import jobs_lines as rules
from activities.control.router_client import RouterClient
from llmgw.store import Store
from llmgw.store.openai_tables import BatchLine, BatchRecord, BatchResult
from llmgw.store.usage import add_usage
from llmgw.types import ChunkRange, ChunkResult

# Its log lines keep the logger they had before the split (operators' config).
log = logging.getLogger("activities.control.jobs")

# A line in flight when its chunk is cancelled gets this long to finish.
CANCEL_GRACE_S = 60.0
# Heartbeats at least this often, whatever the lines do (cancellation
# reaches an activity through its heartbeats).
HEARTBEAT_EVERY_S = 2.0


@dataclass
class ChunkRunner:
    """Runs a chunk's lines not yet done (JobActivities.run_chunk)."""

    _store: Store
    _router: RouterClient
    _clock: Callable[[], float] = time.time
    # Between a line's tries (tests pass one that does not wait).
    _sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    _grace: float = CANCEL_GRACE_S
    # Told when a cancelled chunk stops taking lines (its range, and how
    # many are still in flight): logs, and tests that hold a line until then.
    _on_stopping: Callable[[ChunkRange, int], None] | None = None

    async def run(self, arg: ChunkRange) -> ChunkResult:
        """Run the range's lines not yet done; on cancellation, start no more
        and let those in flight finish (within CANCEL_GRACE_S) and be recorded."""
        batch, lines = await asyncio.to_thread(self._chunk_lines, arg)
        result = ChunkResult(skipped=(arg.last_line - arg.first_line + 1) - len(lines))
        stopping = asyncio.Event()
        slots = asyncio.Semaphore(arg.line_concurrency)
        headers = await self._router.headers(
            batch.key_id,
            **{"X-Llmgw-Priority": "batch", "X-Llmgw-Billed-By-Caller": "1"},
        )

        async def one(line: BatchLine) -> None:
            async with slots:
                if stopping.is_set():
                    return
                ok = await self._run_line(batch, line, headers, stopping)
                if ok is True:
                    result.completed += 1
                elif ok is False:
                    result.failed += 1
                activity.heartbeat(result.model_dump())

        tasks = [asyncio.create_task(one(line)) for line in lines]
        ticker = asyncio.create_task(self._beat(result))
        try:
            if tasks:
                await asyncio.wait(tasks)
        except asyncio.CancelledError:
            stopping.set()
            running = [t for t in tasks if not t.done()]
            log.info(
                "batch %s lines %d-%d cancelled: %d in flight finish first",
                arg.batch_id, arg.first_line, arg.last_line, len(running),
            )  # fmt: skip
            if self._on_stopping is not None:
                self._on_stopping(arg, len(running))
            if running:
                await asyncio.wait(running, timeout=self._grace)
            for task in running:
                task.cancel()
            raise
        finally:
            ticker.cancel()
        for task in tasks:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return result

    async def _beat(self, result: ChunkResult) -> None:
        while True:
            activity.heartbeat(result.model_dump())
            await asyncio.sleep(HEARTBEAT_EVERY_S)

    def _chunk_lines(self, arg: ChunkRange) -> tuple[BatchRecord, list[BatchLine]]:
        """The batch and the range's lines without a result yet."""
        with self._store.session() as session:
            batch = session.get(BatchRecord, arg.batch_id)
            if batch is None:
                raise ApplicationError(f"no batch {arg.batch_id}", non_retryable=True)
            session.expunge(batch)
            done = set(
                session.exec(
                    select(BatchResult.custom_id)
                    .join(
                        BatchLine,
                        and_(
                            col(BatchLine.batch_id) == col(BatchResult.batch_id),
                            col(BatchLine.custom_id) == col(BatchResult.custom_id),
                        ),
                    )
                    .where(
                        BatchResult.batch_id == arg.batch_id,
                        col(BatchLine.line) >= arg.first_line,
                        col(BatchLine.line) <= arg.last_line,
                    )
                ).all()
            )
            lines = [
                line
                for line in session.exec(
                    select(BatchLine)
                    .where(
                        BatchLine.batch_id == arg.batch_id,
                        col(BatchLine.line) >= arg.first_line,
                        col(BatchLine.line) <= arg.last_line,
                    )
                    .order_by(col(BatchLine.line))
                ).all()
                if line.custom_id not in done
            ]
            for line in lines:
                session.expunge(line)
        return batch, lines

    async def _run_line(
        self,
        batch: BatchRecord,
        line: BatchLine,
        headers: dict[str, str],
        stopping: asyncio.Event,
    ) -> bool | None:
        """Send one line until it has an answer to record; True/False: recorded
        ok/failed (None: recorded already by another try, or given up on
        because the chunk stops while the router would not take it yet)."""
        tries = 0
        request_id = "req_" + secrets.token_hex(16)
        body = dict(line.body)
        body.pop("stream", None)
        while True:
            tries += 1
            try:
                answer = await self._router.post(
                    batch.endpoint, body, {**headers, "X-Request-Id": request_id}
                )
            except httpx.TransportError as exc:
                log.info("batch %s line %d: no router (%s); retrying", batch.id, line.line, exc)
                status, data, retry_after = 0, None, None
            else:
                status, retry_after = answer.status_code, answer.headers.get("retry-after")
                try:
                    data = answer.json()
                except ValueError:
                    data = {"error": {"message": answer.text[:1000], "type": "server_error"}}
            verdict = rules.verdict(status, data, tries) if status else rules.Verdict.RETRY
            if verdict is rules.Verdict.RETRY:
                if stopping.is_set():
                    return None  # never ran: finalize lists it
                await self._sleep(rules.backoff_s(tries, retry_after))
                continue
            ok = verdict is rules.Verdict.OK
            inserted = await asyncio.to_thread(
                self._record, batch, line, ok, status, request_id, data
            )
            return ok if inserted else None

    def _record(
        self,
        batch: BatchRecord,
        line: BatchLine,
        ok: bool,
        status: int,
        request_id: str,
        data: Any,
    ) -> bool:
        """The line's result, the batch's counters and the key's usage in one
        transaction; False when the result was there already (nothing added)."""
        prompt, completion = rules.usage_of(data)
        now = self._clock()
        model = str(line.body.get("model", "")) if isinstance(line.body, dict) else ""
        with self._store.session() as session:
            if session.get(BatchResult, (batch.id, line.custom_id)) is not None:
                return False
            session.add(
                BatchResult(
                    batch_id=batch.id,
                    custom_id=line.custom_id,
                    line=line.line,
                    ok=ok,
                    status_code=status,
                    request_id=request_id,
                    body=data if isinstance(data, dict) else {"value": data},
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    created_at=int(now),
                )
            )
            try:
                session.flush()  # the primary key decides: another try may have won
            except IntegrityError:
                session.rollback()
                return False
            table = BatchRecord.__table__  # type: ignore[attr-defined]
            session.connection().execute(
                update(table)
                .where(table.c.id == batch.id)
                .values(
                    completed=table.c.completed + int(ok),
                    failed=table.c.failed + int(not ok),
                    input_tokens=table.c.input_tokens + prompt,
                    output_tokens=table.c.output_tokens + completion,
                )
            )
            add_usage(
                session,
                batch.key_id,
                model,
                _day(now),
                requests=1,
                errors=int(not ok),
                prompt_tokens=prompt,
                completion_tokens=completion,
            )
            try:
                session.commit()
            except IntegrityError:
                session.rollback()
                return False
        return True


def _day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))
