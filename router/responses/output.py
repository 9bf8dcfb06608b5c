"""The output items of one response, and the events that open, grow and close them.

Split from router/responses/events.py: the machine there owns the lifecycle
(created, in progress, the end), the numbering and resuming; this holds its
output as it is generated: the message text streams into, the function calls
(by the engine's tool-call index), and, with ``hold_calls``, calls kept back
until complete. Every event is made through the machine's ``emit``, which
numbers it.
"""

from collections.abc import Callable
from typing import Any

from router.responses.shapes import Event, OutputItem, Status


class Output:
    """A response's output items (see the module's docstring)."""

    def __init__(
        self,
        emit: Callable[..., Event],
        *,
        hold_calls: bool,
        new_message_id: Callable[[], str],
        new_call_item_id: Callable[[], str],
        new_call_id: Callable[[], str],
    ) -> None:
        self._emit = emit
        self._hold_calls = hold_calls
        self._new_message_id = new_message_id
        self._new_call_item_id = new_call_item_id
        self._new_call_id = new_call_id
        self.items: list[OutputItem] = []
        # Open items, by output index: the message text streams into, and the
        # calls of this attempt by the engine's tool-call index.
        self.message: int | None = None
        self._calls: dict[int, int] = {}
        self._held: dict[int, OutputItem] = {}

    @property
    def partial_text(self) -> str:
        """The text of the open message ("" when none is open)."""
        return self.items[self.message].text if self.message is not None else ""

    def open_calls(self) -> list[OutputItem]:
        """Function calls not closed (a stored log that cannot be continued)."""
        return [i for i in self.items if i.kind == "function_call" and i.status == "in_progress"]

    def text(self, content: str) -> list[Event]:
        """The events of ``content`` streamed into the message (opened if none is;
        open calls closed first)."""
        if not content:
            return []
        events = self._close_calls("completed")
        if self.message is None:
            events += self._open_message()
        assert self.message is not None
        item = self.items[self.message]
        item.chunks.append(content)
        events.append(
            self._emit(
                "response.output_text.delta",
                **self._at(self.message),
                content_index=0,
                delta=content,
                logprobs=[],
            )
        )
        return events

    def _open_message(self) -> list[Event]:
        index = len(self.items)
        item = OutputItem("message", self._new_message_id())
        self.items.append(item)
        self.message = index
        return [
            self._emit(
                "response.output_item.added", output_index=index, item=item.dump(empty=True)
            ),
            self._emit(
                "response.content_part.added",
                **self._at(index),
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            ),
        ]

    def call_fragment(self, call: dict[str, Any]) -> list[Event]:
        """The events of one tool-call delta (held whole until the end with
        ``hold_calls``; the open message closed first)."""
        events = self._close_message("completed")
        chat_index = int(call.get("index", 0))
        function = call.get("function") or {}
        if self._hold_calls:
            held = self._held.get(chat_index)
            if held is None:
                held = self._held[chat_index] = self._new_call(call)
            held.name = held.name or function.get("name") or ""
            held.chunks.append(function.get("arguments") or "")
            return events
        if chat_index not in self._calls:
            item = self._new_call(call)
            self._calls[chat_index] = len(self.items)
            self.items.append(item)
            events.append(
                self._emit(
                    "response.output_item.added",
                    output_index=self._calls[chat_index],
                    item=item.dump(empty=True),
                )
            )
        index = self._calls[chat_index]
        item = self.items[index]
        item.name = item.name or function.get("name") or ""
        if function.get("arguments"):
            item.chunks.append(function["arguments"])
            events.append(
                self._emit(
                    "response.function_call_arguments.delta",
                    **self._at(index),
                    delta=function["arguments"],
                )
            )
        return events

    def _new_call(self, call: dict[str, Any]) -> OutputItem:
        function = call.get("function") or {}
        return OutputItem(
            "function_call",
            self._new_call_item_id(),
            call_id=call.get("id") or self._new_call_id(),
            name=function.get("name") or "",
        )

    def close_all(self, status: Status) -> list[Event]:
        """Close every open item with ``status``."""
        return self._close_message(status) + self._close_calls(status)

    def _close_message(self, status: Status) -> list[Event]:
        if self.message is None:
            return []
        index, self.message = self.message, None
        item = self.items[index]
        item.status = status
        return [
            self._emit(
                "response.output_text.done",
                **self._at(index),
                content_index=0,
                text=item.text,
                logprobs=[],
            ),
            self._emit(
                "response.content_part.done", **self._at(index), content_index=0, part=item.part()
            ),
            self._emit("response.output_item.done", output_index=index, item=item.dump()),
        ]

    def _close_calls(self, status: Status) -> list[Event]:
        events: list[Event] = []
        for chat_index in sorted(self._held):
            # A held call is announced whole, once it is complete.
            item = self._held[chat_index]
            index = len(self.items)
            self.items.append(item)
            events.append(
                self._emit(
                    "response.output_item.added", output_index=index, item=item.dump(empty=True)
                )
            )
            if item.text:
                events.append(
                    self._emit(
                        "response.function_call_arguments.delta", **self._at(index), delta=item.text
                    )
                )
            self._calls[chat_index] = index
        self._held.clear()
        for index in sorted(self._calls.values()):
            item = self.items[index]
            item.status = status
            events += [
                self._emit(
                    "response.function_call_arguments.done", **self._at(index), arguments=item.text
                ),
                self._emit("response.output_item.done", output_index=index, item=item.dump()),
            ]
        self._calls.clear()
        return events

    def _at(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index].id, "output_index": index}
