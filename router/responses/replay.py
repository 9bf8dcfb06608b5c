"""Resuming a response: one stored event at a time, back into the state machine.

:meth:`router.responses.events.ResponseEvents.resume` checks the log (it
starts with ``response.created``, numbered from 0 without a gap, no call left
open) and replays each event through :func:`replay`, which sets the machine's
own state as the event once did. Split from router/responses/events.py (the
machine's forward path) so that each reads on its own; the two share the
machine's private state on purpose: a replay is the machine, run backwards.
"""

from typing import Any, Protocol

from llmgw.errors import LlmgwError
from router.responses.output import Output
from router.responses.shapes import Event, OutputItem

# Lifecycle events: each carries the whole Response.
LIFECYCLE = (
    "response.created",
    "response.queued",
    "response.in_progress",
    "response.completed",
    "response.incomplete",
    "response.failed",
)
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class Replayable(Protocol):
    """The machine's state a replay sets (ResponseEvents'; a protocol, so that
    this module does not import the machine that imports it)."""

    _response: dict[str, Any]
    _created: bool
    _started: bool
    _terminal: bool
    _out: Output


class ResponseEventsError(LlmgwError):
    """The state machine was used out of order (a bug in its caller)."""


class NotResumable(ResponseEventsError):
    """Stored events the machine cannot continue from (a gap in the numbering,
    an item out of order, a function call left open)."""


def replay(self: Replayable, event: Event) -> None:
    """Apply one stored event to ``self`` (a machine being resumed)."""
    kind = event["type"]
    if kind in LIFECYCLE:
        self._response = {**event["response"], "output": []}
        self._created = True
        self._started = self._started or kind not in ("response.created", "response.queued")
        self._terminal = kind in TERMINAL
    elif kind == "response.output_item.added":
        _replay_added(self, event)
    elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
        self._out.items[_index(self, event)].chunks.append(event["delta"])
    elif kind == "response.output_item.done":
        index, done = _index(self, event), event["item"]
        item = self._out.items[index]
        item.status = done["status"]
        if item.kind == "message":
            item.chunks = [p.get("text", "") for p in done["content"]]
        else:
            item.chunks = [done["arguments"]]
        if self._out.message == index:
            self._out.message = None


def _replay_added(self: Replayable, event: Event) -> None:
    added = event["item"]
    if event["output_index"] != len(self._out.items):
        raise NotResumable(f"item {added.get('id')} added at {event['output_index']}")
    if added["type"] == "message":
        self._out.message = len(self._out.items)
        self._out.items.append(OutputItem("message", added["id"]))
    else:
        self._out.items.append(
            OutputItem("function_call", added["id"], call_id=added["call_id"], name=added["name"])
        )


def _index(self: Replayable, event: Event) -> int:
    index = event["output_index"]
    if not isinstance(index, int) or not 0 <= index < len(self._out.items):
        raise NotResumable(f"output_index {index} was never added")
    return index
