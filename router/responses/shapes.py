"""The Response object's shapes: the Response before any output, its usage,
and one output item (a message or a function call) as OpenAI shapes it.

Split from router/responses/events.py, the state machine that fills these in
as an engine's chunks arrive: what is built here has no state of its own
and no order, so it reads (and is tested) apart from the machine's rules.
router/responses/events.py names these too, for its importers.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

from router.responses.request import ResponsesRequest, ToolChoiceFunction

Event = dict[str, Any]
Status = Literal["in_progress", "completed", "incomplete"]


def initial_response(
    request: ResponsesRequest, *, response_id: str, created_at: int
) -> dict[str, Any]:
    """The Response object before any output: every field the client reads,
    explicit (``queued`` for a background response, else ``in_progress``)."""
    choice = request.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "queued" if request.background else "in_progress",
        "background": request.background,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": (
            {"type": "function", "name": choice.name}
            if isinstance(choice, ToolChoiceFunction)
            else choice
        ),
        "tools": [t.model_dump() for t in request.tools],
        "truncation": "disabled",
        "usage": None,
        "user": request.user,
        "completed_at": None,
    }


def response_usage(chat_usage: dict[str, Any], carried_output_tokens: int = 0) -> dict[str, Any]:
    """A chat ``usage`` as the Responses usage.

    ``carried_output_tokens`` are output tokens of an earlier attempt that
    this (continued) request took as part of its prompt: they move from
    input to output, the total is unchanged.
    """
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    carried = min(carried_output_tokens, prompt)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return {
        "input_tokens": prompt - carried,
        "input_tokens_details": {
            "cached_tokens": min(cached, prompt - carried),
            # Engines report no cache writes; OpenAI's client requires the field.
            "cache_write_tokens": 0,
        },
        "output_tokens": completion + carried,
        "output_tokens_details": {"reasoning_tokens": int(reasoning or 0)},
        "total_tokens": prompt + completion,
    }


@dataclass
class OutputItem:
    """One output item, as far as it has been generated."""

    kind: Literal["message", "function_call"]
    id: str
    chunks: list[str] = field(default_factory=list)  # the text, or the arguments
    call_id: str = ""
    name: str = ""
    status: Status = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def dump(self, empty: bool = False) -> dict[str, Any]:
        """As OpenAI shapes it (``empty``: as announced by ``output_item.added``)."""
        if self.kind == "message":
            return {
                "id": self.id,
                "type": "message",
                "status": self.status,
                "role": "assistant",
                "content": [] if empty else [self.part()],
            }
        return {
            "id": self.id,
            "type": "function_call",
            "status": self.status,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": "" if empty else self.text,
        }
