"""A response's chat-completions request, made in-process through the
router's own ``/v1/chat/completions`` endpoint (:class:`ChatCall`): the same
key check, admission queue, quota reservation, forwarding and billing as any
chat request. Used by the foreground and background paths alike
(router/api/responses.py, router/api/response_run.py), with the headers it
carries over from the caller and the conversation's session.
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.types import ASGIApp, Message

from router.api.openai import SESSION_HEADER
from router.billing.accounting import HELD_RESERVATION
from router.billing.quotas import QuotaReservation
from router.common.disconnect import disconnect_message
from router.common.errors import relayed_error

log = logging.getLogger("router.api.responses")

CHAT_PATH = "/v1/chat/completions"
# The headers a response's chat request carries over from the client's
# (the key, the executor's, the trace).
CARRIED = (b"authorization", b"traceparent", b"tracestate", b"x-request-id")
EXEC_PREFIX = b"x-llmgw-"
BILLED_BY_CALLER = (b"x-llmgw-billed-by-caller", b"1")


def sse(event: dict[str, Any]) -> bytes:
    kind = str(event["type"]).encode()
    return b"event: " + kind + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ChatCall:
    """One chat-completions request served in-process by the router's own
    inference endpoint (``app.direct``), as if the client had sent it: its
    status, and its body (a JSON answer, or the SSE chunks as dicts).

    ``close`` is the client leaving: the endpoint sees its disconnect
    (it ends the stream and settles the bill as for any client).
    """

    def __init__(
        self,
        app: ASGIApp,
        headers: list[tuple[bytes, bytes]],
        body: dict[str, Any],
        reservation: QuotaReservation | None = None,
    ):
        self._app = app
        # Quota reserved for it already (a background response's, at its
        # creation): the endpoint takes it instead of reserving again.
        self._reservation = reservation
        raw = orjson.dumps(body)
        self._headers = [
            *headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ]
        self._raw = raw
        self._sent_body = False
        self._gone = asyncio.Event()
        self._started = asyncio.Event()
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.status = 0
        self._task: asyncio.Task[None] | None = None

    async def _receive(self) -> Message:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._raw, "more_body": False}
        await self._gone.wait()
        return disconnect_message()

    async def _send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._started.set()
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                self._chunks.put_nowait(body)
            if not message.get("more_body", False):
                self._chunks.put_nowait(None)

    async def start(self) -> None:
        """Send the request; return once the answer's status is known (an
        OpenAIError, as the endpoint answered it, unless 200)."""
        endpoint = self._app.direct[CHAT_PATH]  # type: ignore[attr-defined]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(),
            "query_string": b"", "root_path": "", "headers": self._headers,
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "app": self._app,
        }  # fmt: skip
        held = HELD_RESERVATION.set(self._reservation)
        try:  # the task copies the context: only its request sees the reservation
            self._task = asyncio.create_task(endpoint(scope, self._receive, self._send))
        finally:
            HELD_RESERVATION.reset(held)

        def ended(task: "asyncio.Task[None]") -> None:
            self._chunks.put_nowait(None)
            if not self._started.is_set():
                self.status = 500
                self._started.set()
            if not task.cancelled() and task.exception() is not None:
                log.error("a response's chat request failed", exc_info=task.exception())

        self._task.add_done_callback(ended)
        await self._started.wait()
        if self.status != 200:
            raise relayed_error(self.status, await self._body())

    async def _body(self) -> bytes:
        parts = []
        while (chunk := await self._chunks.get()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def json(self) -> dict[str, Any]:
        """A non-streamed answer's body."""
        data: dict[str, Any] = orjson.loads(await self._body())
        return data

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """A streamed answer's chunks, in order, until the engine's ``[DONE]``."""
        pending = b""
        while (data := await self._chunks.get()) is not None:
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.splitlines():
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    yield orjson.loads(payload)

    def close(self) -> None:
        """The caller is gone: the endpoint ends the request as for a client that left."""
        self._gone.set()


def carried_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k in CARRIED or k.startswith(EXEC_PREFIX)]


def in_session(headers: list[tuple[bytes, bytes]], root: str) -> list[tuple[bytes, bytes]]:
    """The chat request's headers with the conversation's session: every turn
    of a previous_response_id chain shares one sticky key (its first response's
    id), so cache-aware routing sends it where the history is cached."""
    name = SESSION_HEADER.encode()
    return [*((k, v) for k, v in headers if k != name), (name, f"resp:{root}".encode())]
