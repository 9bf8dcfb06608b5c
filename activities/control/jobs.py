"""The durable jobs' activities (task queue ``exec``) and their sweeper.

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
"""

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy import and_, func, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select
from temporalio import activity
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError

from activities.control import jobs_lines as rules
from llmgw import contracts
from llmgw.engine_keys import exec_token
from llmgw.queues import EXEC_QUEUE, batch_workflow_id, response_workflow_id
from llmgw.store import Store
from llmgw.store.files import write_file
from llmgw.store.openai_tables import BatchLine, BatchRecord, BatchResult, ResponseRecord
from llmgw.store.usage import add_usage
from llmgw.types import (
    TERMINAL_BATCH,
    BatchId,
    BatchLineError,
    BatchRun,
    BatchState,
    BatchStatus,
    BatchStatusChange,
    BatchValidation,
    CancelJob,
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

# A line in flight when its chunk is cancelled gets this long to finish.
CANCEL_GRACE_S = 60.0
# Heartbeats at least this often, whatever the lines do (cancellation
# reaches an activity through its heartbeats).
HEARTBEAT_EVERY_S = 2.0
# Results files are written from the store: no bound but the store's.
RESULT_FILE_MAX_BYTES = 1 << 40
# Rows read per page by finalize.
PAGE = 500

_AT_FIELD = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


class RouterClient:
    """The routers' URLs, with the exec token; on a connection error the
    next URL is tried (another router serves as well as the first)."""

    def __init__(
        self,
        urls: list[str],
        secret: Callable[[], Awaitable[str]],
        http: httpx.AsyncClient | None = None,
    ) -> None:
        if not urls:
            raise ValueError("no router URL")
        self._urls = urls
        self._next = 0
        self._secret = secret
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def headers(self, key_id: int | None = None, **extra: str) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {exec_token(await self._secret())}", **extra}
        if key_id is not None:
            headers["X-Llmgw-Key-Id"] = str(key_id)
        return headers

    def _url(self, path: str) -> str:
        return self._urls[self._next % len(self._urls)] + path

    def _rotate(self) -> None:
        self._next += 1

    async def post(self, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
        """POST to a router; httpx.TransportError once every URL failed to connect."""
        last: httpx.TransportError | None = None
        for _ in range(len(self._urls)):
            try:
                return await self._http.post(self._url(path), json=body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                last = exc
                self._rotate()
        assert last is not None
        raise last

    @contextlib.asynccontextmanager
    async def stream(self, path: str, headers: dict[str, str]) -> AsyncIterator[httpx.Response]:
        """A streamed POST to a router (the next URL on a connection error)."""
        last: httpx.TransportError | None = None
        for _ in range(len(self._urls)):
            try:
                async with self._http.stream(
                    "POST", self._url(path), headers=headers, json={}
                ) as response:
                    yield response
                    return
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = exc
                self._rotate()
        assert last is not None
        raise last

    async def aclose(self) -> None:
        await self._http.aclose()


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
        self._sleep = sleep
        self._grace = cancel_grace_s
        # Told when a cancelled chunk stops taking lines (its range, and how
        # many are still in flight): logs, and tests that hold a line until then.
        self._on_stopping = on_stopping

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

    @activity.defn(name=contracts.RUN_CHUNK.name)
    async def run_chunk(self, arg: ChunkRange) -> ChunkResult:
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

    # -- finalize -------------------------------------------------------------

    @activity.defn(name=contracts.FINALIZE_BATCH.name)
    async def finalize_batch(self, arg: FinalizeBatch) -> Finalized:
        """Write the output and error files (deterministic ids: a retry
        replaces them) and set them on the batch."""
        return await asyncio.to_thread(self._finalize, arg)

    def _finalize(self, arg: FinalizeBatch) -> Finalized:
        with self._store.session() as session:
            batch = session.get(BatchRecord, arg.batch_id)
            if batch is None:
                raise ApplicationError(f"no batch {arg.batch_id}", non_retryable=True)
            key_id = batch.key_id
        oks, errors, never = self._counts(arg.batch_id)
        if not arg.never_ran_code:
            never = 0  # a completed batch ran every line
        out_id = err_id = None
        if oks:
            out_id = rules.result_file_id(arg.batch_id, "out")
            write_file(
                self._store, key_id, f"{arg.batch_id}_output.jsonl", "batch_output",
                self._jsonl(arg.batch_id, want_ok=True, never_ran_code=""),
                max_bytes=RESULT_FILE_MAX_BYTES, file_id=out_id,
            )  # fmt: skip
        if errors or never:
            err_id = rules.result_file_id(arg.batch_id, "err")
            write_file(
                self._store, key_id, f"{arg.batch_id}_error.jsonl", "batch_output",
                self._jsonl(arg.batch_id, want_ok=False, never_ran_code=arg.never_ran_code),
                max_bytes=RESULT_FILE_MAX_BYTES, file_id=err_id,
            )  # fmt: skip
        with self._store.session() as session:
            batch = session.get(BatchRecord, arg.batch_id)
            assert batch is not None
            batch.output_file_id = out_id
            batch.error_file_id = err_id
            if never:
                # Lines that never ran are in the error file: counted as failed
                # (assigned, not added: finalize may run twice).
                batch.failed = batch.total - batch.completed
            session.add(batch)
            session.commit()
        return Finalized(output_file_id=out_id, error_file_id=err_id)

    def _counts(self, batch_id: str) -> tuple[int, int, int]:
        """(ok results, failed results, lines without a result)."""
        with self._store.session() as session:
            oks = session.exec(
                select(func.count())
                .select_from(BatchResult)
                .where(BatchResult.batch_id == batch_id, col(BatchResult.ok).is_(True))
            ).one()
            results = session.exec(
                select(func.count())
                .select_from(BatchResult)
                .where(BatchResult.batch_id == batch_id)
            ).one()
            lines = session.exec(
                select(func.count()).select_from(BatchLine).where(BatchLine.batch_id == batch_id)
            ).one()
        return int(oks), int(results) - int(oks), max(0, int(lines) - int(results))

    def _jsonl(self, batch_id: str, *, want_ok: bool, never_ran_code: str) -> Iterator[bytes]:
        """The file's lines in input order, a page of rows at a time."""
        after = 0
        while True:
            with self._store.session() as session:
                rows = session.exec(
                    select(BatchLine.line, BatchLine.custom_id, BatchResult)
                    .join(
                        BatchResult,
                        and_(
                            col(BatchResult.batch_id) == col(BatchLine.batch_id),
                            col(BatchResult.custom_id) == col(BatchLine.custom_id),
                        ),
                        isouter=True,
                    )
                    .where(BatchLine.batch_id == batch_id, col(BatchLine.line) > after)
                    .order_by(col(BatchLine.line))
                    .limit(PAGE)
                ).all()
                page: list[bytes] = []
                for number, custom_id, result in rows:
                    after = number
                    if result is None:
                        if not want_ok and never_ran_code:
                            page.append(
                                _dump(rules.never_ran_line(batch_id, custom_id, never_ran_code))
                            )
                        continue
                    if result.ok is want_ok:
                        page.append(
                            _dump(
                                rules.output_line(
                                    batch_id, custom_id, result.status_code, result.request_id,
                                    result.body,
                                )
                            )
                        )  # fmt: skip
            if not rows:
                return
            if page:
                yield b"".join(page)

    # -- background responses ---------------------------------------------------

    @activity.defn(name=contracts.RUN_RESPONSE.name)
    async def run_response(self, arg: ResponseRun) -> ResponseRunResult:
        """Have a router run (or continue) the stored response; heartbeats per
        event it persisted. A lost connection or a 5xx is retried by Temporal
        (the router continues from the stored events)."""
        headers = await self._router.headers()
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


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


# -- the sweeper ------------------------------------------------------------------

# A row this young may still be started by the router that inserted it.
SWEEP_MIN_AGE_S = 3.0
START_RPC_TIMEOUT = timedelta(seconds=5)


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
    ) -> None:
        self._store = store
        self._client = client
        self._defaults = run_defaults
        self._queue = task_queue
        self._clock = clock
        self._min_age = min_age_s

    async def forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.once()
            except Exception:  # a sweep that fails is the next one's to do
                log.exception("job sweep failed")
            await asyncio.sleep(interval_s)

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
        # Both tables have started_at; a plain UPDATE keeps it one statement.
        t = table.__table__  # type: ignore[union-attr]
        with self._store.session() as session:
            session.connection().execute(
                update(t)
                .where(t.c.id == row_id, t.c.started_at.is_(None))
                .values(started_at=int(self._clock()))
            )
            session.commit()


async def start_batch(
    client: Client, batch_id: str, expires_at: float, defaults: BatchRun, task_queue: str
) -> None:
    """Start a batch's workflow unless it runs or ran already."""
    run = defaults.model_copy(update={"batch_id": batch_id, "expires_at": float(expires_at)})
    with contextlib.suppress(WorkflowAlreadyStartedError):
        await contracts.BATCH.start(
            client, run, id=batch_workflow_id(batch_id), task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            rpc_timeout=START_RPC_TIMEOUT,
        )  # fmt: skip


async def start_response(client: Client, response_id: str, task_queue: str) -> None:
    """Start a background response's workflow unless it runs or ran already."""
    with contextlib.suppress(WorkflowAlreadyStartedError):
        await contracts.RESPONSE.start(
            client, ResponseRun(response_id=response_id), id=response_workflow_id(response_id),
            task_queue=task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            rpc_timeout=START_RPC_TIMEOUT,
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
