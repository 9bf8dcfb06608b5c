"""A Responses request, and the conversation before it, as a chat-completions body.

Engines (llama.cpp, vLLM, SGLang) serve chat completions; their own
``/v1/responses``, where there is one, lacks what OpenAI's client needs
(sequence numbers, indexes), so the router translates. Everything here is
pure: dicts in, dicts out.

The mapping (Responses -> chat):

- ``instructions`` -> a first ``system`` message; a ``developer`` message ->
  ``system`` (chat templates rarely know the developer role);
- a message's text parts -> one string (joined by newlines: most templates
  take no typed content); with an ``input_image`` part the content stays a
  list of typed parts (``text`` and ``image_url``);
- ``function_call`` items -> the assistant message's ``tool_calls`` (one
  message for consecutive calls, and the text message just before them);
- ``function_call_output`` -> a ``tool`` message for its ``call_id``;
- flat function tools -> chat's nested ``{"type":"function","function":{...}}``,
  a named ``tool_choice`` likewise; tools, tool_choice and
  parallel_tool_calls go to the engine only when there are tools (vLLM
  refuses a tool_choice without tools);
- ``text.format``: ``json_schema`` -> ``response_format`` (nested),
  ``json_object`` likewise, ``text`` -> nothing;
- ``max_output_tokens`` -> ``max_tokens``; a stream always asks for usage
  (``stream_options.include_usage``): the router bills it.

A continuation (a retried background generation, research §4.3) appends the
text already streamed as a partial assistant message; llama.cpp echoes that
prefix at the start of its answer, vLLM does not: :class:`PrefixStripper`
removes it only where it is echoed.
"""

from collections.abc import Iterable, Sequence
from typing import Any

from router.responses.request import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputImage,
    InputText,
    Item,
    MessageItem,
    OutputText,
    Refusal,
    ResponsesRequest,
    ToolChoiceFunction,
)

ChatBody = dict[str, Any]
ChatMessage = dict[str, Any]

# The roles chat templates know.
_CHAT_ROLE = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def chat_body(
    request: ResponsesRequest, history: Sequence[Item] = (), *, stream: bool | None = None
) -> ChatBody:
    """The chat-completions body for ``request``, after the conversation ``history``
    (the input and output items of the responses before it, oldest first).

    ``stream`` overrides the request's own (a background run always streams).
    Only this request's ``instructions`` apply: OpenAI does not carry them
    over through ``previous_response_id``.
    """
    streaming = request.stream if stream is None else stream
    body: ChatBody = {
        "model": request.model,
        "messages": chat_messages(request.instructions, [*history, *request.items()]),
        "stream": streaming,
    }
    if streaming:
        body["stream_options"] = {"include_usage": True}
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    # prompt_cache_key steers the router's cache-aware routing (docs/guides/routing.md).
    for name in ("temperature", "top_p", "user", "prompt_cache_key"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = [chat_tool(t) for t in request.tools]
        body["tool_choice"] = chat_tool_choice(request.tool_choice)
        body["parallel_tool_calls"] = request.parallel_tool_calls
    response_format = chat_response_format(request)
    if response_format is not None:
        body["response_format"] = response_format
    return body


def chat_messages(instructions: str | None, items: Iterable[Item]) -> list[ChatMessage]:
    """The chat messages for ``items``, after a system message of ``instructions``."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": _CHAT_ROLE[item.role], "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            _append_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
    return messages


def _append_call(messages: list[ChatMessage], item: FunctionCallItem) -> None:
    """A call joins the assistant turn just before it (its text or its other calls)."""
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not isinstance(last["content"], list):
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _part_text(part: ContentPart) -> str:
    if isinstance(part, InputText | OutputText):
        return part.text
    if isinstance(part, Refusal):
        return part.refusal
    return ""


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(p) for p in content if not isinstance(p, InputImage))


def _content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    """A message's content: a string, or typed parts when it carries an image."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _text(content)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, InputImage):
            image: dict[str, Any] = {"url": part.image_url}
            if part.detail in ("low", "high", "auto"):
                image["detail"] = part.detail
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": _part_text(part)})
    return parts


def chat_tool(tool: FunctionTool) -> dict[str, Any]:
    """A flat Responses function tool in chat's nested shape."""
    function: dict[str, Any] = {"name": tool.name}
    for name in ("description", "parameters", "strict"):
        value = getattr(tool, name)
        if value is not None:
            function[name] = value
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | ToolChoiceFunction) -> str | dict[str, Any]:
    """``none``/``auto``/``required`` unchanged; a named function nested."""
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def chat_response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None for plain text)."""
    fmt = request.text.format
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.json_schema}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}
    return None


def continuation_body(body: ChatBody, partial: str, max_tokens: int | None = None) -> ChatBody:
    """``body`` asking the engine to continue ``partial``, the assistant text
    already streamed to clients (a copy; ``body`` is left as it was).

    The partial text ends the messages as an assistant turn (joining the
    conversation's last message when that is already the assistant's plain
    text: engines refuse two assistant messages at the end), with
    ``continue_final_message`` and no generation prompt (vLLM needs both,
    llama.cpp accepts them). ``max_tokens`` replaces the bound when given
    (what is left of ``max_output_tokens``).
    """
    messages = [dict(m) for m in body["messages"]]
    last = messages[-1] if messages else None
    if (
        last is not None
        and last["role"] == "assistant"
        and isinstance(last.get("content"), str)
        and not last.get("tool_calls")
    ):
        last["content"] += partial
    else:
        messages.append({"role": "assistant", "content": partial})
    continued = {
        **body,
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    if max_tokens is not None:
        continued["max_tokens"] = max_tokens
    return continued


def strip_prefix(content: str, prefix: str) -> str:
    """A non-streamed continuation's content without the echoed ``prefix``
    (unchanged when the engine did not echo it)."""
    return content[len(prefix) :] if prefix and content.startswith(prefix) else content


class PrefixStripper:
    """Removes an echoed ``prefix`` from the start of a stream of text deltas.

    llama.cpp's first delta of a continuation carries the prefix (and maybe
    more); vLLM sends only new text. Text is held while it could still be
    the echo; once it departs from the prefix it is all passed on, once it
    covers the prefix the prefix is dropped. Should an engine that does not
    echo generate exactly the prefix as its first text, that text is taken
    for the echo: the one ambiguity, with no way to tell.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._held = ""
        self._decided = not prefix

    def feed(self, delta: str) -> str:
        """The part of ``delta`` (and of what was held) to pass on now."""
        if self._decided:
            return delta
        self._held += delta
        if self._held.startswith(self._prefix):
            self._decided = True
            return self._held[len(self._prefix) :]
        if self._prefix.startswith(self._held):
            return ""
        self._decided = True
        return self._held

    def flush(self) -> str:
        """What is still held at the end of the stream (text that was a prefix of
        the prefix but never all of it: the engine's own)."""
        held, self._held = ("" if self._decided else self._held), ""
        self._decided = True
        return held
