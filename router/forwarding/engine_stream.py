"""An engine's answer read for what the router needs of it: its usage (billed,
and the prompt and cached tokens cache-aware routing learns from), and a
stream relayed to the client event by event, counting content chunks so a
stream cut short is billed what it carried (router/forwarding/proxy.py
chooses the replica and starts the exchange; this module reads it)."""

import copy
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Send

from llmgw.errors import UpstreamError
from router.billing.accounting import RequestOutcome
from router.common.metrics import Metrics
from router.control_link.routing import Route
from router.forwarding.cache_report import hide_in, mentions
from router.forwarding.call import Call
from router.forwarding.pacing import Pacer
from router.forwarding.relay import Pour
from router.forwarding.upstream import UpstreamResponse, divertible

log = logging.getLogger(__name__)


def _count(value: object) -> int:
    """A token count from an engine's usage; anything odd counts 0."""
    return value if isinstance(value, int) and value > 0 else 0


def _parse(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        # What orjson refuses and the standard library reads (NaN, integers
        # past 64 bits, UTF-16): as before.
        return json.loads(content)


def outcome_of(status: int, content: bytes) -> RequestOutcome:
    if status != 200:
        return RequestOutcome(error=True, status=status)
    try:
        usage = _parse(content).get("usage")
    except (ValueError, AttributeError):
        return RequestOutcome()
    if not isinstance(usage, dict):
        return RequestOutcome()
    return RequestOutcome(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=_cached(usage),
    )


@dataclass(frozen=True, slots=True)
class Usage:
    """What an engine reported of a prompt (cache-aware routing learns it)."""

    prompt_tokens: int | None
    cached_tokens: int | None

    @classmethod
    def of(cls, outcome: RequestOutcome) -> "Usage | None":
        """From an answer's outcome; None when it carried no usage."""
        if not outcome.prompt_tokens and outcome.cached_tokens is None:
            return None
        return cls(outcome.prompt_tokens or None, outcome.cached_tokens)


def _cached(usage: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (llama.cpp, vLLM), or None
    when the engine does not say."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and cached >= 0 else None


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

    def __init__(
        self,
        upstream: UpstreamResponse,
        route: Route,
        call: Call,
        metrics: Metrics,
        pacer: Pacer | None = None,
        served: "Callable[[Usage | None], None] | None" = None,
        hide: bool = False,
    ):
        self._upstream = upstream
        self._route = route
        self._call = call
        self._metrics = metrics
        self._pacer = pacer
        self._counted = 0
        self._usage: dict[str, Any] | None = None
        self._finished = False
        self._buf = b""  # an event not complete yet
        self._first = True
        # Told the engine's usage when the relay ends (cache-aware routing learns it).
        self.served = served
        # The client must not see the engine's cache figures (cached tokens,
        # timings): its cache is shared with other scopes (cache_report.py).
        self._hide = hide

    def _scan(self, events: bytes) -> bytes:
        """The events to pass on, event by event; counts content chunks and notes usage.

        Only an event that mentions usage is parsed (the last one, normally),
        or, where the caller must not see the cache's figures (``hide``), one
        that mentions them; the others are counted by a byte pattern, a
        fraction of a JSON parse.
        """
        out: list[bytes] = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            hide = self._hide and mentions(event)
            if b'"usage"' not in event and not hide:
                self._counted += len(_CONTENT.findall(event))
                out.append(event + b"\n\n")
                continue
            keep = event
            obj = _json_event(event)
            if obj is not None:
                changed = False
                choices = obj.get("choices")
                if isinstance(choices, list):
                    self._counted += sum(1 for c in choices if _has_content(c))
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    # As the engine said (billing, metrics, the index), before hiding.
                    self._usage = copy.deepcopy(usage) if hide else usage
                    if self._call.strip_usage:
                        if not choices:
                            continue  # the usage-only chunk: the client did not ask
                        del obj["usage"]
                        changed = True
                if hide and hide_in(obj):
                    changed = True
                if changed:
                    keep = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
            out.append(keep + b"\n\n")
        return b"".join(out)

    def _pass(self, events: bytes) -> bytes:
        """What ``_scan`` gives, without splitting when it would give ``events`` back:
        no usage (or only ``"usage":null``, which engines in OpenAI's manner put
        in every chunk), no empty event (four newlines, or one ending the last read)."""
        if (
            (b'"usage"' in events and events.count(b'"usage"') != events.count(b'"usage":null'))
            or b"\n\n\n\n" in events
            or events.startswith(b"\n\n")
            or (self._hide and mentions(events))
        ):
            return self._scan(events)
        # The pattern holds no newline: counting the whole read counts each event.
        self._counted += len(_CONTENT.findall(events))
        return events

    def _events(self, chunk: bytes) -> bytes:
        """The complete events up to this chunk, counted (``_pass``); an
        incomplete last one waits for the next chunk."""
        data = self._buf + chunk if self._buf else chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self._buf = data
            return b""
        if cut == len(data):
            self._buf = b""
        else:
            data, self._buf = data[:cut], data[cut:]
        out = self._pass(data)
        if out and self._first:
            self._first = False
            self._metrics.ttft.labels(self._call.model).observe(
                time.monotonic() - self._call.started
            )
        return out

    async def pump(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """Answer with ``headers`` and relay the stream until it ends (or this task
        is cancelled: the client left, even before it took the answer's head)."""
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        error = False
        try:
            diverted = divertible(self._upstream)
            if diverted is not None:
                await Pour(self._events, diverted, send, self._pacer, self._started).over
            else:
                async for chunk in self._upstream.chunks():
                    out = self._events(chunk)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
            if self._buf:
                await send({"type": "http.response.body", "body": self._buf, "more_body": True})
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
        # Accounting, then the close (synchronous: a cancellation cannot cut
        # it short), so the engine sees the connection close.
        self._route.inflight -= 1
        self._call.bill.settle(self._outcome(error))
        self._upstream.close()
        if self.served is not None:
            usage = self._usage
            self.served(
                None
                if usage is None
                else Usage(_count(usage.get("prompt_tokens")) or None, _cached(usage))
            )

    def _started(self) -> bool:
        """Whether the client has had a token (a role-only first event is none)."""
        return self._counted > 0

    def _outcome(self, error: bool) -> RequestOutcome:
        if self._usage is not None:
            return RequestOutcome(
                prompt_tokens=_count(self._usage.get("prompt_tokens")),
                completion_tokens=_count(self._usage.get("completion_tokens")),
                error=error,
                cached_tokens=_cached(self._usage),
            )
        return RequestOutcome(
            prompt_tokens=self._call.bill.prompt_estimate,
            completion_tokens=self._counted,
            error=error,
        )
