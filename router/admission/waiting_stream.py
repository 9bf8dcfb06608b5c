"""A streamed request that waits for a replica after its 200 went out.

A stream that has waited a few seconds in the admission queue is answered
200 at once and sent an SSE comment (``: waiting for a replica``) every few
seconds, so proxies and load balancers in front do not time out a silent
connection (SSE clients, the openai one included, skip comments). Once a
replica takes it, the engine's events follow as if nothing had happened.
A failure after the 200 (the wait ran out, the wake failed, the engine
refused) is the stream's last event: ``data: {"error": {...}}``.
"""

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Protocol

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.admission.ticket import Forward, Ticket
from router.common.disconnect import disconnected
from router.common.errors import ErrorKind, OpenAIError, engine_refused, sse_error
from router.forwarding.call import Call

log = logging.getLogger(__name__)

COMMENT = b": waiting for a replica\n\n"
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-llmgw-queued", b"true"),
]


class Queue(Protocol):
    """What a waiting stream asks of the queue it waits in
    (router.admission.queue.Admission, which makes the stream: this module
    does not import it)."""

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def stream_comment_s(self) -> float: ...

    async def wait(
        self, ticket: Ticket, until: float, gone: "asyncio.Future[None] | None"
    ) -> bool: ...

    async def start(self, ticket: Ticket, forward: Forward) -> ASGIApp: ...

    def timed_out(self, ticket: Ticket, max_wait_s: float) -> OpenAIError: ...

    def leave(self, ticket: Ticket, reason: str) -> None: ...


class WaitingStream(Response):
    """The ASGI answer of a stream still waiting for a replica."""

    def __init__(
        self,
        admission: Queue,
        ticket: Ticket,
        deadline: float,
        max_wait_s: float,
        call: Call,
        forward: Forward,
    ) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self._admission = admission
        self._ticket = ticket
        self._deadline = deadline
        self._max_wait_s = max_wait_s
        self._call = call
        self._forward = forward

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        if not await self._wait(receive, send):
            return
        try:
            response = await self._admission.start(self._ticket, self._forward)
        except OpenAIError as exc:
            await self._fail(send, exc)
            return
        except Exception:
            log.exception("forwarding a stream that waited failed")
            await self._fail(send, ErrorKind.INTERNAL_ERROR.error())
            return
        await response(scope, receive, _BodyOnly(send).send)

    async def _wait(self, receive: Receive, send: Send) -> bool:
        """Comments until the ticket is dispatched (True), or the error sent (False)."""
        admission, ticket = self._admission, self._ticket
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            while True:
                until = min(self._deadline, admission.clock() + admission.stream_comment_s)
                try:
                    if await admission.wait(ticket, until, gone):
                        return True
                except OpenAIError as exc:
                    await self._fail(send, exc)
                    return False
                if admission.clock() >= self._deadline:
                    await self._fail(send, admission.timed_out(ticket, self._max_wait_s))
                    return False
                await send({"type": "http.response.body", "body": COMMENT, "more_body": True})
        except BaseException:
            # Cancelled, or a comment could not be sent: the client is gone.
            admission.leave(ticket, "gone")
            self._call.bill.failed(499)
            raise
        finally:
            gone.cancel()

    async def _fail(self, send: Send, error: OpenAIError) -> None:
        """Account the request as failed and end the stream with the error
        (none for a client that left: nobody reads it)."""
        self._call.bill.failed(error.status)
        body = b"" if error.status == 499 else sse_error(error)
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _BodyOnly:
    """Passes an inner response's body on under the 200 already sent; an inner
    error answer (the engine refused) becomes the stream's error event."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._status = 200
        self._error = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = int(message["status"])
            return
        if message["type"] != "http.response.body" or self._status == 200:
            await self._send(message)
            return
        self._error += message.get("body", b"")
        if not message.get("more_body", False):
            body = _error_event(self._status, self._error)
            await self._send({"type": "http.response.body", "body": body, "more_body": False})


def _error_event(status: int, body: bytes) -> bytes:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return b"data: " + json.dumps(parsed, separators=(",", ":")).encode() + b"\n\n"
    return sse_error(engine_refused(status, body.decode(errors="replace")))
