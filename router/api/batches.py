"""OpenAI's Batch API (``/v1/batches``), the router's side.

A create inserts one row (``validating``, ``expires_at`` 24 h on) and asks
the executor to start the batch's workflow (``Jobs.start_batch``: fire and
forget, started with USE_EXISTING on ``batch/<id>``; the control worker's
sweeper starts what it missed), then answers: nothing waits on Temporal.
The executor then calls ``POST /internal/batches/{id}/validate`` here, which
checks every line of the input file against this router's request schemas
and the key's models, and copies the lines into the store; it runs the
lines through the ordinary inference endpoints. Cancel moves a running batch
to ``cancelling`` at once and signals the workflow (``Jobs.cancel_batch``).
"""

import asyncio
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw.errors import StoreError
from llmgw.store import files
from llmgw.store.openai_tables import BatchRecord
from router.api.auth import Caller
from router.api.deps import Deps, get_deps
from router.api.openai import CallerDep
from router.api.openapi_docs import error_responses
from router.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from router.batches import records
from router.batches.validate import BodyCheck, BodyRefused, Rules, validate_batch
from router.billing.key_policy import KeyPolicy
from router.billing.quotas import QuotaRejection
from router.common.blocking import within
from router.common.errors import QUOTA_EXCEEDED, ErrorKind, invalid_body
from router.common.metadata import METADATA_PAIRS, Metadata
from router.responses.request import RequestInvalid, validate_request

router = APIRouter(prefix="/v1", tags=["batches"])
internal = APIRouter(prefix="/internal", include_in_schema=False)

DepsDep = Annotated[Deps, Depends(get_deps)]
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
_NOT_FOUND = "No such batch for this API key (another key's batch is not found either)"
# A batch's creation as ``llmgw_requests`` counts it.
BATCHES_ENDPOINT = "batches"


class BatchJobs(Protocol):
    """The executor's side (router/control_link/jobs.py's Jobs, contract §5)."""

    def start_batch(self, batch_id: str) -> None: ...

    def cancel_batch(self, batch_id: str) -> None: ...


def _jobs(request: Request) -> BatchJobs | None:
    """The app's Jobs (None: no executor link; the control worker's sweeper
    starts new batches and re-signals cancelling ones on its own)."""
    jobs: BatchJobs | None = getattr(request.app.state, "jobs", None)
    return jobs


class BatchCreate(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, description="an uploaded file with purpose batch")
    endpoint: Endpoint = Field(description="where every line of the file goes")
    completion_window: Literal["24h"] = Field(description="only 24h")
    metadata: Metadata | None = Field(default=None, description=f"at most {METADATA_PAIRS} pairs")
    # Accepted for the client's sake; output files follow the files' own expiry.
    output_expires_after: dict[str, Any] | None = None


async def _store(deps: Deps, fn: Callable[[], Any]) -> Any:
    """A store call on a request's path, bounded as every such call is: a
    store that fails or stalls past the bound is a 503, not a 500."""
    try:
        return await within(deps.store_wait_s, fn)
    except StoreError as exc:
        raise ErrorKind.STORE_UNAVAILABLE.error() from exc


@router.post(
    "/batches",
    responses=error_responses(
        {
            404: "No such input file for this API key",
            400: "An invalid field (`param` names it)",
            429: "The key's requests per minute (or tokens) are spent: a batch's creation"
            " is one request of its key's",
        }
    ),
)
async def create_batch(
    body: BatchCreate, request: Request, deps: DepsDep, caller: CallerDep
) -> dict[str, Any]:
    """Create a batch of the requests in an uploaded JSONL file (OpenAI's Batch API)."""
    file_id = body.input_file_id
    found = await _store(deps, lambda: files.get_file(deps.store, caller.key_id, file_id))
    if found is None:
        raise ErrorKind.BATCH_FILE_NOT_FOUND.error(file_id=file_id)
    if found.purpose != "batch":
        raise ErrorKind.BATCH_FILE_PURPOSE.error(file_id=file_id, purpose=found.purpose)
    await _meter_creation(deps, caller)
    now = int(time.time())
    record = BatchRecord(
        id=records.batch_id(), key_id=caller.key_id, endpoint=body.endpoint,
        input_file_id=file_id, completion_window=body.completion_window, status="validating",
        created_at=now, expires_at=now + records.COMPLETION_WINDOW_S[body.completion_window],
        meta=body.metadata,
    )  # fmt: skip
    await _store(deps, lambda: records.insert_batch(deps.store, record))
    jobs = _jobs(request)
    if jobs is not None:
        jobs.start_batch(record.id)
    return records.batch_object(record)


async def _meter_creation(deps: Deps, caller: Caller) -> None:
    """A batch's creation is one request of its key's: it reserves one of the
    key's requests per minute (no tokens: each line reserves and is billed
    its own, as it runs), so a key limited to N requests a minute creates at
    most N batches a minute, and it is counted in ``llmgw_requests``
    (endpoint ``batches``). Refused: the 429 a chat request would get."""
    reservation = await deps.accountant.reserve(caller.key_id, caller.policy, 0)
    if isinstance(reservation, QuotaRejection):
        deps.metrics.quota_rejections.labels(reservation.limit).inc()
        error = QUOTA_EXCEEDED[reservation.limit].error(
            message=reservation.message, retry_after_s=reservation.retry_after_s
        )
        deps.metrics.requests.labels(BATCHES_ENDPOINT, "", str(error.status)).inc()
        raise error
    deps.metrics.requests.labels(BATCHES_ENDPOINT, "", "200").inc()


async def _owned(deps: Deps, caller: Caller, batch_id: str) -> BatchRecord:
    # Text without a batch id's shape is no batch: a 404 without the store (a
    # store that is slow to answer would make it a 503).
    record: BatchRecord | None = None
    if records.is_batch_id(batch_id):
        record = await _store(deps, lambda: records.get_batch(deps.store, caller.key_id, batch_id))
    if record is None:
        raise ErrorKind.BATCH_NOT_FOUND.error(batch_id=batch_id)
    return record


@router.get("/batches/{batch_id}", responses=error_responses({404: _NOT_FOUND}))
async def retrieve_batch(batch_id: str, deps: DepsDep, caller: CallerDep) -> dict[str, Any]:
    """A batch: its status, timestamps, request counts, errors and result files."""
    return records.batch_object(await _owned(deps, caller, batch_id))


@router.get("/batches")
async def list_batches(
    deps: DepsDep,
    caller: CallerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    """This key's batches, newest first; ``after`` is the last id of the page before."""
    rows: list[BatchRecord] = []
    more = False
    if after is None or records.is_batch_id(after):  # else no batch's: an empty page
        rows, more = await _store(
            deps, lambda: records.list_batches(deps.store, caller.key_id, after=after, limit=limit)
        )
    data = [records.batch_object(r) for r in rows]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


@router.post(
    "/batches/{batch_id}/cancel",
    responses=error_responses(
        {404: _NOT_FOUND, 400: "The batch has ended (or is finalizing): nothing to cancel"}
    ),
)
async def cancel_batch(
    batch_id: str, request: Request, deps: DepsDep, caller: CallerDep
) -> dict[str, Any]:
    """Cancel a batch: ``cancelling`` at once; lines in flight end first, then
    ``cancelled`` with the lines that finished in its output."""
    now = int(time.time())
    cancel: records.Cancel | None = None
    if records.is_batch_id(batch_id):
        cancel = await _store(
            deps, lambda: records.cancel_batch(deps.store, caller.key_id, batch_id, now)
        )
    if cancel is None:
        raise ErrorKind.BATCH_NOT_FOUND.error(batch_id=batch_id)
    if not cancel.moved and cancel.record.status not in records.CANCELLED:
        raise ErrorKind.BATCH_NOT_CANCELLABLE.error(batch_status=cancel.record.status)
    jobs = _jobs(request)
    if cancel.moved and jobs is not None:
        jobs.cancel_batch(batch_id)
    return records.batch_object(cancel.record)


# The executor's endpoint (contract §4).

_SCHEMAS: dict[str, type[ChatCompletionRequest | CompletionRequest | EmbeddingRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


def body_check(endpoint: str, policy: KeyPolicy) -> BodyCheck:
    """The check a batch line's body gets: the endpoint's request schema, as
    a client's request would (no stream: a line's answer is one JSON body)."""

    def prefixed(param: str | None) -> str:
        return f"body.{param}" if param else "body"

    def responses(body: dict[str, Any]) -> str:
        try:
            req = validate_request(body)
        except RequestInvalid as exc:
            raise BodyRefused(exc.message, prefixed(exc.param)) from None
        for name in ("stream", "background"):
            if getattr(req, name):
                raise BodyRefused(f"A batch line cannot set {name}.", f"body.{name}")
        return req.model

    def inference(body: dict[str, Any]) -> str:
        try:
            req = _SCHEMAS[endpoint].model_validate(body)
        except ValidationError as exc:
            error = invalid_body(exc)
            raise BodyRefused(error.message, prefixed(error.param)) from None
        if getattr(req, "stream", False):
            raise BodyRefused("A batch line cannot set stream.", "body.stream")
        unbounded = getattr(req, "unbounded", None)
        if unbounded is not None and unbounded() and (policy.tpm or policy.token_budget):
            message = ErrorKind.UNBOUNDED_GENERATION.error().message
            raise BodyRefused(message, "body.n_predict")
        return req.model

    return responses if endpoint == "/v1/responses" else inference


@internal.post("/batches/{batch_id}/validate")
async def validate(batch_id: str, deps: DepsDep, caller: CallerDep) -> dict[str, Any]:
    """Check every line of a batch's input file and store its lines (the
    executor's first step; exec token only). Runs in a thread."""
    if not getattr(caller, "exec", False):
        raise ErrorKind.EXEC_ONLY.error()
    record = await _owned(deps, caller, batch_id)
    # The models the router knows now (the catalog, adapters, replicas'):
    # the table is the event loop's, so the thread gets a copy.
    known = frozenset(deps.table.known_models)
    rules = Rules(
        endpoint=record.endpoint,
        check_body=body_check(record.endpoint, caller.policy),
        allows=caller.policy.allows,
        knows=known.__contains__,
    )

    def run() -> dict[str, Any]:
        lines = files.iter_lines(deps.store, record.input_file_id)
        outcome = validate_batch(deps.store, batch_id, lines, rules)
        return {"total": outcome.total, "errors": [e.as_dict() for e in outcome.errors]}

    result: dict[str, Any] = await asyncio.to_thread(run)
    return result


# This module's routes, public and internal, for the app to include.
routes = APIRouter()
routes.include_router(router)
routes.include_router(internal)
