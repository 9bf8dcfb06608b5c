"""The executor's endpoint: ``POST /internal/responses/{id}/run`` generates
(or continues, from its stored events) a background response, persisting its
events a flush at a time (every ``FLUSH_EVENTS`` events or ``FLUSH_S``
seconds, at every item's end and at the end): a killed run loses at most
that much, which its retry regenerates, and the store takes a few writes a
second per response, not one per token. The executor (the control worker's
response workflow) calls it on any router; ``GET /v1/responses/{id}?stream=true``
tails what it stored (router/api/responses.py).
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp

from llmgw.errors import LlmgwError, StoreError
from llmgw.store.openai_tables import ResponseRecord
from router.api.deps import Deps, get_deps
from router.api.openai import SESSION_HEADER
from router.api.response_chat import (
    BILLED_BY_CALLER,
    EXEC_PREFIX,
    ChatCall,
    carried_headers,
    sse,
)
from router.api.response_quota import held_reservation
from router.billing.quotas import QuotaReservation
from router.common.blocking import within
from router.common.errors import ErrorKind, OpenAIError
from router.responses import store as rstore
from router.responses.bounds import run_refusal
from router.responses.ending import fail_run
from router.responses.events import STREAM_CUT, NotResumable, ResponseEvents
from router.responses.translate import continuation_body

# Its log lines keep the logger they had before the split (operators' config).
log = logging.getLogger("router.api.responses")

internal = APIRouter(prefix="/internal", include_in_schema=False)
DepsDep = Annotated[Deps, Depends(get_deps)]

T = TypeVar("T")

FLUSH_EVENTS = 32
FLUSH_S = 0.25


@internal.post("/responses/{response_id}/run", response_model=None)
async def run_response(response_id: str, request: Request, deps: DepsDep) -> Response:
    """Generate (or continue, from its stored events) a stored background
    response as its key, persisting its events; SSE of the events persisted,
    or a JSON status when it has already ended.

    The exec token of the response's own key only (another key's response
    is not found; the executor may also name the key in ``X-Llmgw-Key-Id``).
    """
    authorization = request.headers.get("authorization")
    try:
        bound = await deps.keys.verify_exec(authorization)
    except OpenAIError:
        raise ErrorKind.EXEC_ONLY.error() from None
    record: ResponseRecord | None = await _store(
        deps, lambda: rstore.get_response(deps.store, None, response_id)
    )
    named = request.headers.get("x-llmgw-key-id")
    if (
        record is None
        or record.key_id != bound  # the token acts as its own key's responses only
        or (named is not None and named.strip() != str(record.key_id))
    ):
        raise ErrorKind.RESPONSE_NOT_FOUND.error(response_id=response_id)
    if record.status in rstore.TERMINAL:
        return JSONResponse({"id": response_id, "status": record.status})
    attempt, status = await _store(deps, lambda: rstore.begin_attempt(deps.store, response_id))
    if status not in rstore.RUNNING:
        # Cancelled since it was read: it never generates (the cancel gave
        # back its reservation, the first attempt not having begun).
        return JSONResponse({"id": response_id, "status": status})
    stored: list[dict[str, Any]] = await _store(
        deps, lambda: rstore.events_after(deps.store, response_id, -1)
    )
    refusal = run_refusal(attempt, record.created_at, time.time())
    if refusal is not None:
        # A run that keeps failing (a 429 that never clears, an engine lost
        # again and again) or runs too long ends: failed, with what it stored.
        log.warning("background response %s: %s, failing it", response_id, refusal)
        message = f"The response could not be generated: {refusal}."
        await asyncio.to_thread(fail_run, deps.store, response_id, stored, message)
        return JSONResponse({"id": response_id, "status": "failed"})
    try:
        machine = ResponseEvents.resume(stored)
        if machine.response["output"] and not machine.partial_text:
            # Only an open message's text can be continued: generating anew
            # would repeat the items already streamed.
            raise NotResumable("no open message to continue")
    except NotResumable as exc:
        log.warning("background response %s cannot be continued: %s", response_id, exc)
        await asyncio.to_thread(fail_run, deps.store, response_id, stored, STREAM_CUT)
        return JSONResponse({"id": response_id, "status": "failed"})
    chat = dict(record.request["chat"])
    partial = machine.partial_text
    if partial:
        limit = chat.get("max_tokens")
        left = None if limit is None else max(1, limit - machine.carried_output_tokens)
        chat = continuation_body(chat, partial, left)
    # As the response's key, billed by the run (once, with the final usage).
    headers = [
        *(
            (k, v)
            for k, v in carried_headers(request.scope["headers"])
            if not k.startswith(EXEC_PREFIX)
        ),
        (b"x-llmgw-key-id", str(record.key_id).encode()),
        BILLED_BY_CALLER,
        (SESSION_HEADER.encode(), f"resp:{record.request.get('root') or record.id}".encode()),
    ]
    # The first attempt's request takes the quota reserved at creation
    # (router/api/response_quota.py; a cancel before begin_attempt gives it
    # back instead, never both); a later one reserves anew.
    reservation = held_reservation(record.key_id, record.request) if attempt == 1 else None
    run = _Run(deps, response_id, machine)
    return StreamingResponse(
        run.events(request.app, headers, chat, reservation), media_type="text/event-stream"
    )


async def _store(deps: Deps, fn: Callable[[], T]) -> T:
    """A store call of the run, bounded: past the wait a 503 the executor retries."""
    try:
        return await within(deps.store_wait_s, fn)
    except StoreError as exc:
        raise ErrorKind.STORE_UNAVAILABLE.error() from exc


def _out_of_room(carried: int) -> dict[str, Any]:
    """What a continuation that no longer fits the context ends as: output
    cut at its limit (response.incomplete, reason max_output_tokens), billed
    the ``carried`` output tokens stored (its prompt is not known: the engine
    refused it, as for a cancel it is not billed)."""
    usage = {"prompt_tokens": carried, "completion_tokens": 0, "total_tokens": carried}
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage}


class _Run:
    """One attempt at a background response: its events persisted in flushes."""

    def __init__(self, deps: Deps, response_id: str, machine: ResponseEvents) -> None:
        self._deps = deps
        self._id = response_id
        self._machine = machine
        self._pending: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self._cancelled = False
        self._lost = False  # another run of it stored these events first
        self._finished = False  # the engine gave a finish_reason
        self._deltas = 0  # text and arguments deltas this attempt stored

    async def _flush(self) -> list[dict[str, Any]]:
        if not self._pending:
            return []
        events, self._pending = self._pending, []
        try:
            self._cancelled = await asyncio.to_thread(
                rstore.append_events, self._deps.store, self._id, events
            )
        except rstore.RunLost:
            # Two runs at once (a retry while the first still ran): the
            # other one goes on, this one stops without a word more.
            log.warning("background response %s: another run is ahead, stopping", self._id)
            self._lost = True
            return []
        self._last_flush = time.monotonic()
        self._deltas += sum(e["type"].endswith(".delta") for e in events)
        return events

    def _due(self, events: list[dict[str, Any]]) -> bool:
        return (
            len(self._pending) >= FLUSH_EVENTS
            or time.monotonic() - self._last_flush >= FLUSH_S
            or any(e["type"] == "response.output_item.done" for e in events)
        )

    async def _step(
        self, events: list[dict[str, Any]], force: bool = False
    ) -> AsyncIterator[bytes]:
        self._pending += events
        if force or self._due(events):
            for event in await self._flush():
                yield sse(event)

    async def events(
        self,
        app: ASGIApp,
        headers: list[tuple[bytes, bytes]],
        chat: dict[str, Any],
        reservation: QuotaReservation | None = None,
    ) -> AsyncIterator[bytes]:
        """The attempt, as the SSE of the events it persisted."""
        machine = self._machine
        async for out in self._step(machine.in_progress(), force=True):
            yield out
        if self._cancelled or self._lost:
            return
        call = ChatCall(app, headers, chat, reservation)
        try:
            async for out in self._generate(call):
                yield out
        finally:
            call.close()
        if self._lost:
            return
        if self._cancelled:
            # The cancel wrote the status; what was generated is billed.
            await self._bill_cancelled()
            return
        if not machine.terminal and not self._finished:
            # The engine's stream broke off: keep what was generated, and let
            # the executor retry (the next attempt continues from it).
            async for out in self._step([], force=True):
                yield out
            raise RunInterrupted(self._id)
        async for out in self._step([] if machine.terminal else machine.finish(), force=True):
            yield out
        await self._finish()

    async def _generate(self, call: ChatCall) -> AsyncIterator[bytes]:
        machine = self._machine
        try:
            await call.start()
        except OpenAIError as exc:
            if exc.status >= 500 or exc.status == 429:
                raise  # for the executor to retry (no replica, queue full...)
            if machine.partial_text and exc.status == 400 and "context" in exc.message.lower():
                # The text so far, tokenized anew in the continuation, leaves
                # no room in the engine's context (it may take more tokens
                # than it was generated as): the output ends here, as at its
                # token limit, with everything generated kept.
                self._finished = True
                async for out in self._step(
                    machine.feed(_out_of_room(machine.carried_output_tokens))
                ):
                    yield out
                return
            # Refused for good (the key may no longer use the model): it failed.
            async for out in self._step(machine.fail(exc.message)):
                yield out
            return
        async for chunk in call.chunks():
            choices = chunk.get("choices") or []
            self._finished = self._finished or any(c.get("finish_reason") for c in choices)
            async for out in self._step(machine.feed(chunk)):
                yield out
            if self._cancelled or self._lost or machine.terminal:
                return

    async def _finish(self) -> None:
        machine = self._machine
        await asyncio.to_thread(rstore.finish_run, self._deps.store, self._id, machine.response)

    async def _bill_cancelled(self) -> None:
        """A run cut by a cancel has no engine usage: its output is billed as
        one token a stored delta (its prompt is not known, and not billed)."""
        output = self._machine.carried_output_tokens + self._deltas
        usage = {"input_tokens": 0, "output_tokens": output, "total_tokens": output}
        response = {**self._machine.response, "usage": usage}
        await asyncio.to_thread(rstore.finish_run, self._deps.store, self._id, response)


class RunInterrupted(LlmgwError):
    """A background run's engine stream ended early (the executor retries)."""
