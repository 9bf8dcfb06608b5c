"""An engine's chat-completion chunks as the Responses stream, and its final Response.

:class:`ResponseEvents` is a pure state machine: it takes the chunks an
engine streams (dicts: content deltas, tool-call deltas, ``finish_reason``,
``usage``) and returns the events OpenAI's client parses, numbered from 0
without a gap (research §1.4)::

    response.created, response.in_progress,
    per message:  output_item.added, content_part.added, output_text.delta...,
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta...,
                  function_call_arguments.done, output_item.done
    response.completed | response.incomplete | response.failed

Items are numbered (``output_index``) in the order they open. A message is
closed when a tool call begins, and open tool calls when text comes again;
everything still open closes at the end. The items and the events that open,
grow and close them are router/responses/output.py; the shapes the machine
fills in (the Response before output, usage, an item), router/responses/shapes.py.

**Resuming** (research §5.3): :meth:`ResponseEvents.resume` rebuilds the
machine from the events already stored, so a retried generation continues
the numbering and the open message (its text is the prefix the engine is
asked to continue; the echo of it is stripped). A function call cannot be
continued by an engine, so a log meant to be resumed is made with
``hold_calls``: a call's events are emitted only once it is complete, and a
log with a call left open is :class:`NotResumable`. The replay of one stored
event is router/responses/replay.py.

The end: ``finish_reason`` ``length`` -> ``response.incomplete`` (reason
``max_output_tokens``), ``content_filter`` -> incomplete too, any other ->
``response.completed``; a stream that ends without a finish reason, or an
error chunk, -> ``response.failed`` with ``server_error`` and a fixed message
(an engine's text may carry what clients must not see: router/errors.py).
"""

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

from router.responses import ids
from router.responses.output import Output
from router.responses.replay import NotResumable, ResponseEventsError, replay
from router.responses.shapes import (
    Event,
    Status,
    initial_response,
    response_usage,
)
from router.responses.translate import PrefixStripper

# Named here too (explicit re-exports): importers take them from the machine's module.
__all__ = [
    "ENGINE_FAILED",
    "STREAM_CUT",
    "Event",
    "NotResumable",
    "ResponseEvents",
    "ResponseEventsError",
    "Status",
    "initial_response",
    "response_from_completion",
    "response_usage",
]

ENGINE_FAILED = "The engine failed while generating the response."
STREAM_CUT = "The engine's stream ended before the response was complete."
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


class ResponseEvents:
    """The Responses event stream of one response (see the module's docstring).

    ``response`` is the Response object before output (:func:`initial_response`,
    or the last one stored). Item ids and ``completed_at`` come from the
    injected ``ids``-like callables and ``clock``.
    """

    def __init__(
        self,
        response: dict[str, Any],
        *,
        hold_calls: bool = False,
        new_message_id: Callable[[], str] = ids.message_id,
        new_call_item_id: Callable[[], str] = ids.function_call_id,
        new_call_id: Callable[[], str] = ids.call_id,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._response = {**response, "output": []}
        self._out = Output(
            self._event,
            hold_calls=hold_calls,
            new_message_id=new_message_id,
            new_call_item_id=new_call_item_id,
            new_call_id=new_call_id,
        )
        self._clock = clock
        self._seq = 0
        self._created = False
        self._started = False
        self._terminal = False
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._stripper: PrefixStripper | None = None
        self._carried = 0

    # The state a caller reads.

    @property
    def next_sequence_number(self) -> int:
        """The number the next event will carry."""
        return self._seq

    @property
    def terminal(self) -> bool:
        """Whether the terminal event (completed, incomplete, failed) was emitted."""
        return self._terminal

    @property
    def partial_text(self) -> str:
        """The text of the open message ("" when none is open): what a
        continuation asks the engine to continue."""
        return self._out.partial_text

    @property
    def carried_output_tokens(self) -> int:
        """Output tokens an earlier attempt generated (estimated on resume)."""
        return self._carried

    @property
    def response(self) -> dict[str, Any]:
        """The Response object now (its output as far as generated)."""
        # A copy: events keep the snapshot they were sent with.
        return copy.deepcopy(
            {**self._response, "output": [item.dump() for item in self._out.items]}
        )

    # The lifecycle.

    def created(self) -> list[Event]:
        """``response.created`` (once), with the status the response has now."""
        if self._created:
            return []
        self._created = True
        return [self._event("response.created", response=self.response)]

    def in_progress(self) -> list[Event]:
        """``response.in_progress`` (once; ``response.created`` first if not sent)."""
        events = self.created()
        if not self._started:
            self._started = True
            self._response["status"] = "in_progress"
            events.append(self._event("response.in_progress", response=self.response))
        return events

    def start(self) -> list[Event]:
        """The events before any output: created and in_progress."""
        return self.in_progress()

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events one chat-completion chunk makes (maybe none)."""
        self._open_check()
        events = self.in_progress()
        if chunk.get("error") is not None:
            return events + self.fail(ENGINE_FAILED)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # Responses has one answer; n > 1 is never asked for.
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._out.call_fragment(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[Event]:
        """The end of the engine's stream: close what is open, then the terminal event."""
        self._open_check()
        events = self.in_progress()
        if self._stripper is not None:
            events += self._out.text(self._stripper.flush())
        if self._finish_reason is None:
            return events + self.fail(STREAM_CUT)
        reason = _INCOMPLETE.get(self._finish_reason)
        events += self._out.close_all("incomplete" if reason else "completed")
        self._terminal = True
        final: dict[str, Any] = {
            "usage": self._usage_now(),
            "status": "incomplete" if reason else "completed",
        }
        if reason:
            final["incomplete_details"] = {"reason": reason}
            self._response.update(final)
            return [*events, self._event("response.incomplete", response=self.response)]
        final["completed_at"] = int(self._clock())
        self._response.update(final)
        return [*events, self._event("response.completed", response=self.response)]

    def fail(self, message: str, code: str = "server_error") -> list[Event]:
        """``response.failed`` (open items closed as incomplete first)."""
        self._open_check()
        events = self.in_progress() + self._out.close_all("incomplete")
        self._terminal = True
        self._response.update(
            status="failed", error={"code": code, "message": message}, usage=self._usage_now()
        )
        return [*events, self._event("response.failed", response=self.response)]

    # Resuming.

    @classmethod
    def resume(
        cls,
        events: Sequence[Event],
        *,
        carried_output_tokens: int | None = None,
        strip_echo: bool = True,
        hold_calls: bool = True,
        new_message_id: Callable[[], str] = ids.message_id,
        new_call_item_id: Callable[[], str] = ids.function_call_id,
        new_call_id: Callable[[], str] = ids.call_id,
        clock: Callable[[], float] = time.time,
    ) -> "ResponseEvents":
        """The machine as it was after ``events`` (the stored log, in order from 0).

        The open message continues: its text is :attr:`partial_text`, and
        with ``strip_echo`` the engine's echo of it is dropped from the next
        deltas. ``carried_output_tokens`` defaults to the number of deltas
        stored (engines stream about one token a delta).
        """
        if not events or events[0].get("type") != "response.created":
            raise NotResumable("a stored log starts with response.created")
        machine = cls(
            events[0]["response"],
            hold_calls=hold_calls,
            new_message_id=new_message_id,
            new_call_item_id=new_call_item_id,
            new_call_id=new_call_id,
            clock=clock,
        )
        deltas = 0
        for seq, event in enumerate(events):
            if event.get("sequence_number") != seq:
                raise NotResumable(
                    f"event {seq} carries sequence_number {event.get('sequence_number')}"
                )
            deltas += event["type"].endswith(".delta")
            replay(machine, event)
        machine._seq = len(events)
        open_calls = machine._out.open_calls()
        if open_calls:
            raise NotResumable(f"function call {open_calls[0].id} was left open")
        if machine._out.message is not None and strip_echo:
            machine._stripper = PrefixStripper(machine.partial_text)
        machine._carried = deltas if carried_output_tokens is None else carried_output_tokens
        return machine

    def _text(self, content: str) -> list[Event]:
        if self._stripper is not None:
            content = self._stripper.feed(content)
        return self._out.text(content)

    def _usage_now(self) -> dict[str, Any] | None:
        return None if self._usage is None else response_usage(self._usage, self._carried)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _open_check(self) -> None:
        if self._terminal:
            raise ResponseEventsError("the response has ended")


def response_from_completion(
    response: dict[str, Any],
    completion: dict[str, Any],
    *,
    new_message_id: Callable[[], str] = ids.message_id,
    new_call_item_id: Callable[[], str] = ids.function_call_id,
    new_call_id: Callable[[], str] = ids.call_id,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """The final Response for a non-streamed chat ``completion`` (the same
    mapping as the stream's, through the same machine)."""
    machine = ResponseEvents(
        response,
        new_message_id=new_message_id,
        new_call_item_id=new_call_item_id,
        new_call_id=new_call_id,
        clock=clock,
    )
    choices = completion.get("choices") or [{}]
    message = choices[0].get("message") or {}
    calls = [{**call, "index": i} for i, call in enumerate(message.get("tool_calls") or [])]
    chunk = {
        "choices": [
            {
                "index": 0,
                "delta": {"content": message.get("content"), "tool_calls": calls},
                "finish_reason": choices[0].get("finish_reason"),
            }
        ],
        "usage": completion.get("usage"),
    }
    if completion.get("error") is not None:
        chunk = {"error": completion["error"]}
    machine.feed(chunk)
    if not machine.terminal:
        machine.finish()
    return machine.response
