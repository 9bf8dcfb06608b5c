"""The router's answers as plain ASGI: a whole one, or an engine's SSE stream relayed.

No Starlette Response objects on the hot path: an answer is its status,
header list and body, sent in two ASGI messages. A stream is relayed as the
engine's reads come (each read, however many events it holds, is one write
to the client: coalesced by the socket, never split), counting content
chunks by a byte pattern; only an event that mentions usage is parsed.

A client that goes away mid-stream cancels the relay; closing the upstream
response closes the connection, which llama.cpp and vLLM take as a
cancellation. What was relayed until then is billed: one token per streamed
chunk with content (exact for llama.cpp, which sends a chunk per token), or
the engine's own usage when the stream got that far.
"""

import asyncio
import json
import logging
import re
import time
from typing import TYPE_CHECKING, Any

import anyio
from starlette.types import Receive, Scope, Send

from llmgw.errors import UpstreamError
from router.accounting import Outcome
from router.metrics import Metrics
from router.routing import Route
from router.upstream import UpstreamResponse

if TYPE_CHECKING:
    from router.proxy import Call

log = logging.getLogger(__name__)


def media_header(media: str) -> bytes:
    """A Content-Type as Starlette sent it: text types get a charset if they name none."""
    if media.startswith("text/") and "charset=" not in media.lower():
        media += "; charset=utf-8"
    return media.encode("latin-1")


class Reply:
    """A whole answer: status, headers (lower-case names) and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def count(value: object) -> int:
    """A token count from an engine's usage; anything odd counts 0."""
    return value if isinstance(value, int) and value > 0 else 0


# A choice's delta (or text) with something in it: one token, as engines stream.
_CONTENT = re.compile(rb'"(?:content|text|reasoning_content)":"(?!")|"tool_calls":\[')


def _json_event(event: bytes) -> dict[str, Any] | None:
    if not event.startswith(b"data: {"):
        return None
    try:
        obj = json.loads(event[6:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    part = delta if isinstance(delta, dict) else choice
    return bool(
        part.get("content") or part.get("text") or part.get("reasoning_content")
        or part.get("tool_calls")
    )  # fmt: skip


class Relay:
    """Relays one SSE stream, counting content chunks and (maybe) stripping usage."""

    def __init__(self, upstream: UpstreamResponse, route: Route, call: "Call", metrics: Metrics):
        self._upstream = upstream
        self._route = route
        self._call = call
        self._metrics = metrics
        self._counted = 0
        self._usage: dict[str, Any] | None = None
        self._finished = False

    def _scan(self, events: bytes) -> bytes:
        """The events to pass on, event by event; counts content chunks and notes usage.

        Only an event that mentions usage is parsed (the last one, normally);
        the others are counted by a byte pattern, a fraction of a JSON parse.
        """
        out: list[bytes] = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            if b'"usage"' not in event:
                self._counted += len(_CONTENT.findall(event))
                out.append(event + b"\n\n")
                continue
            keep = event
            obj = _json_event(event)
            if obj is not None:
                choices = obj.get("choices")
                if isinstance(choices, list):
                    self._counted += sum(1 for c in choices if _has_content(c))
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    self._usage = usage
                    if self._call.strip_usage:
                        if not choices:
                            continue  # the usage-only chunk: the client did not ask
                        del obj["usage"]
                        keep = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
            out.append(keep + b"\n\n")
        return b"".join(out)

    def _pass(self, events: bytes) -> bytes:
        """What ``_scan`` gives, without splitting when it would give ``events`` back:
        no usage, no empty event (four newlines, or one ending the last read)."""
        if b'"usage"' in events or b"\n\n\n\n" in events or events.startswith(b"\n\n"):
            return self._scan(events)
        # The pattern holds no newline: counting the whole read counts each event.
        self._counted += len(_CONTENT.findall(events))
        return events

    async def pump(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """Answer with ``headers`` and relay the stream until it ends (or this task
        is cancelled: the client left, even before it took the answer's head)."""
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        buf = b""
        first = True
        error = False
        try:
            async for chunk in self._upstream.chunks():
                data = buf + chunk if buf else chunk
                cut = data.rfind(b"\n\n") + 2
                if cut < 2:
                    buf = data
                    continue
                if cut == len(data):
                    buf = b""
                else:
                    data, buf = data[:cut], data[cut:]
                out = self._pass(data)
                if out:
                    if first:
                        first = False
                        self._metrics.ttft.labels(self._call.model).observe(
                            time.monotonic() - self._call.started
                        )
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            if buf:
                await send({"type": "http.response.body", "body": buf, "more_body": True})
        except UpstreamError as exc:
            error = True
            self._metrics.upstream_errors.labels(
                self._call.model, self._route.replica_id, "stream"
            ).inc()
            log.warning("stream from %s broke: %s", self._route.replica_id, exc)
        await self.finish(error)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def finish(self, error: bool = False) -> None:
        """Account and release, once: after the stream, or when it never started."""
        if self._finished:
            return
        self._finished = True
        # Accounting first, with no await, then close upstream shielded from
        # the cancellation so the engine sees the connection close.
        self._route.inflight -= 1
        self._call.on_done(self._outcome(error))
        with anyio.CancelScope(shield=True):
            await self._upstream.close()

    def _outcome(self, error: bool) -> Outcome:
        if self._usage is not None:
            return Outcome(
                prompt_tokens=count(self._usage.get("prompt_tokens")),
                completion_tokens=count(self._usage.get("completion_tokens")),
                error=error,
            )
        return Outcome(
            prompt_tokens=self._call.prompt_estimate, completion_tokens=self._counted, error=error
        )


class StreamReply:
    """A relayed stream as an ASGI answer; releases its relay whatever happens
    (a client gone before the first byte, or mid-stream)."""

    def __init__(self, relay: Relay, media: str, replica_id: str) -> None:
        self._relay = relay
        self.headers = [
            (b"x-llmgw-replica", replica_id.encode()),
            (b"content-type", media_header(media)),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _unless_gone(self._relay.pump(send, self.headers), receive)
        finally:
            await self._relay.finish()


async def _unless_gone(relay: Any, receive: Receive) -> None:
    """Run the relay in this task while one watcher waits for the client's
    disconnect (a task per stream, nothing per event); a disconnect cancels it."""
    task = asyncio.current_task()
    assert task is not None
    active, left = True, False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        if active:  # not once the relay is over
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await relay
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
    except OSError:
        pass  # the server could not write to a client that left
    finally:
        active = False
        watcher.cancel()
