"""Chat-completion chunks as the Responses event stream (router/responses/events.py).

Every event and Response is parsed strictly with the installed openai client's
own types, with no field the types do not know, and every whole stream is
replayed through the client's own stream state machine (the one
``client.responses.stream`` runs), which raises on an inconsistent stream.
"""

import itertools
import json
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent, ToolChoiceFunction
from pydantic import BaseModel, TypeAdapter

from router.responses.events import (
    ENGINE_FAILED,
    STREAM_CUT,
    Event,
    NotResumable,
    ResponseEvents,
    ResponseEventsError,
    initial_response,
    response_from_completion,
    response_usage,
)
from router.responses.request import validate_request

EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
CREATED_AT = 1_796_500_000
DONE_AT = CREATED_AT + 3
USAGE = {
    "prompt_tokens": 20,
    "completion_tokens": 4,
    "total_tokens": 24,
    "prompt_tokens_details": {"cached_tokens": 16},
}


def counter(prefix: str) -> Callable[[], str]:
    numbers = itertools.count(1)
    return lambda: f"{prefix}{next(numbers)}"


def machine(body: dict[str, Any] | None = None, **kw: Any) -> ResponseEvents:
    request = validate_request(body or {"model": "tiny", "input": "hi"})
    return ResponseEvents(
        initial_response(request, response_id="resp_1", created_at=CREATED_AT),
        new_message_id=counter("msg_"),
        new_call_item_id=counter("fc_"),
        new_call_id=counter("call_gen"),
        clock=lambda: DONE_AT,
        **kw,
    )


def content(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def call(
    index: int, arguments: str, call_id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    fragment: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        fragment |= {"id": call_id, "type": "function"}
        fragment["function"]["name"] = name
    return {"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}, "finish_reason": None}]}


def finish(reason: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


def usage(chat_usage: dict[str, Any] = USAGE) -> dict[str, Any]:
    return {"choices": [], "usage": chat_usage}


def run(m: ResponseEvents, chunks: Iterable[dict[str, Any]], end: bool = True) -> list[Event]:
    events = m.start()
    for chunk in chunks:
        events += m.feed(chunk)
    return events + m.finish() if end else events


# OpenAI's API returns ``store`` in a Response, but openai 3.63's Response type
# does not declare it: the one field sent beyond the types, on purpose.
UNDECLARED = {"Response": {"store"}}


def no_unknown_fields(model: BaseModel, where: str = "") -> None:
    """No field the client's types do not declare (a misspelt one would pass
    their lenient parse as an extra)."""
    extra = set(model.model_extra or {}) - UNDECLARED.get(type(model).__name__, set())
    assert not extra, f"{where}: unknown fields {extra}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for inner in value if isinstance(value, list) else [value]:
            if isinstance(inner, BaseModel):
                no_unknown_fields(inner, f"{where}.{name}")


def parsed(events: list[Event]) -> list[ResponseStreamEvent]:
    """``events`` as the client parses them, strictly, and as JSON off the wire."""
    out = []
    for event in events:
        typed = EVENT.validate_python(event, strict=True)
        assert EVENT.validate_json(json.dumps(event), strict=True) == typed
        no_unknown_fields(typed, event["type"])
        out.append(typed)
    return out


def client_final(events: list[Event]) -> Response:
    """The stream replayed through the client's own state machine; its final Response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state: ResponseStreamState[object] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in parsed(events):
        state.handle_event(event)
    assert state._completed_response is not None
    return state._completed_response


def final_response(events: list[Event]) -> Response:
    response = Response.model_validate(events[-1]["response"], strict=True)
    no_unknown_fields(response, "response")
    return response


def types(events: list[Event]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


# Text.


def test_a_text_answer_streams_openais_event_sequence() -> None:
    m = machine()
    events = run(m, [content("Hel"), content("lo"), finish("stop"), usage()])
    assert types(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(10))
    assert events[0]["response"]["status"] == "in_progress"
    assert events[4]["item_id"] == events[6]["item_id"] == "msg_1"
    assert events[6]["text"] == "Hello"
    final = client_final(events)
    assert final.output_text == "Hello"
    assert final.status == "completed"
    assert final.completed_at == DONE_AT
    response = final_response(events)
    # The client's accumulated answer is the one in response.completed.
    assert [(o.id, getattr(o, "status", None)) for o in final.output] == [("msg_1", "completed")]
    assert response.output_text == final.output_text
    assert response.usage is not None
    assert response.usage.model_dump() == {
        "input_tokens": 20,
        "input_tokens_details": {
            "cached_tokens": 16,
            "cache_write_tokens": 0,
            "cache_write_tokens_details": None,
        },
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 24,
    }
    assert m.terminal
    assert m.response == events[-1]["response"]


def test_a_background_response_is_created_queued() -> None:
    m = machine({"model": "tiny", "input": "hi", "background": True})
    created = m.created()
    assert created[0]["response"]["status"] == "queued"
    assert created[0]["response"]["background"] is True
    parsed(created)
    # Later (in the executor), the rest continues the numbering.
    rest = run(m, [content("x"), finish("stop")])
    assert types(rest)[:2] == ["in_progress", "output_item.added"]
    assert rest[0]["response"]["status"] == "in_progress"
    assert client_final(created + rest).output_text == "x"


def test_the_request_is_echoed_in_the_response() -> None:
    body = {
        "model": "tiny",
        "input": "hi",
        "instructions": "Be brief.",
        "max_output_tokens": 9,
        "temperature": 0.3,
        "top_p": 0.8,
        "metadata": {"job": "7"},
        "user": "u",
        "previous_response_id": "resp_0",
        "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
    }
    response = final_response(run(machine(body), [content("ok"), finish("stop")]))
    assert response.instructions == "Be brief."
    assert (response.max_output_tokens, response.temperature, response.top_p) == (9, 0.3, 0.8)
    assert response.metadata == {"job": "7"}
    assert response.previous_response_id == "resp_0"
    assert response.parallel_tool_calls is False
    assert response.tool_choice == ToolChoiceFunction(type="function", name="f")
    assert [t.model_dump(exclude_none=True) for t in response.tools] == [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}
    ]
    assert response.usage is None  # the engine sent none


def test_a_json_schema_answer_echoes_its_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "model": "tiny",
        "input": "a number",
        "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    }
    events = run(machine(body), [content('{"a" :'), content("9}"), finish("stop"), usage()])
    final = client_final(events)
    assert json.loads(final.output_text) == {"a": 9}
    response = final_response(events)
    assert response.text is not None
    assert response.text.model_dump(by_alias=True, exclude_none=True) == {
        "format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}
    }


# Function calls.


def test_tool_call_deltas_stream_as_function_call_items() -> None:
    events = run(
        machine(),
        [
            call(0, "", call_id="call_a", name="get_weather"),
            call(0, '{"city":'),
            call(0, '"Paris"}'),
            call(1, '{"city":"Rome"}', call_id="call_b", name="get_weather"),
            finish("tool_calls"),
            usage(),
        ],
    )
    assert types(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    final = client_final(events)
    assert [(o.type, o.id, getattr(o, "call_id", None)) for o in final.output] == [
        ("function_call", "fc_1", "call_a"),
        ("function_call", "fc_2", "call_b"),
    ]
    calls = final_response(events).output
    assert [json.loads(getattr(c, "arguments", "")) for c in calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert final_response(events).status == "completed"


def test_text_then_a_call_closes_the_message_first() -> None:
    events = run(
        machine(),
        [content("Let me look."), call(0, "{}", name="f"), finish("tool_calls")],
    )
    assert types(events)[2:] == [
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    final = client_final(events)
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert getattr(final.output[1], "call_id", "") == "call_gen1"  # the engine gave none


def test_held_calls_are_emitted_whole_once_complete() -> None:
    m = machine(hold_calls=True)
    events = m.start()
    for chunk in [call(0, "", call_id="call_a", name="f"), call(0, '{"x":'), call(0, "1}")]:
        assert m.feed(chunk) == []
    events += m.feed(finish("tool_calls")) + m.finish()
    assert types(events)[2:] == [
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    assert events[3]["delta"] == '{"x":1}'
    assert getattr(client_final(events).output[0], "arguments", "") == '{"x":1}'


# The other ends.


def test_max_tokens_ends_incomplete() -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    events = run(machine(body), [content("Hel"), content("lo"), finish("length"), usage()])
    assert types(events)[-1] == "incomplete"
    parsed(events)
    response = final_response(events)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert getattr(response.output[0], "status", None) == "incomplete"
    assert response.output_text == "Hello"
    assert response.completed_at is None
    assert events[-2]["item"]["status"] == "incomplete"


def test_a_cut_stream_or_an_error_chunk_fails_with_a_fixed_message() -> None:
    cut = run(machine(), [content("Hel")])
    assert types(cut)[-1] == "failed"
    parsed(cut)
    response = final_response(cut)
    assert response.status == "failed"
    assert response.error is not None
    assert (response.error.code, response.error.message) == ("server_error", STREAM_CUT)
    assert (
        getattr(response.output[0], "status", None) == "incomplete"
    )  # the open message was closed

    m = machine()
    events = m.start() + m.feed(content("a"))
    events += m.feed({"error": {"message": "CUDA OOM on node gpu-7 /srv/secret"}})
    assert m.terminal
    parsed(events)
    failed = final_response(events)
    assert failed.error is not None
    assert failed.error.message == ENGINE_FAILED
    assert "gpu-7" not in json.dumps(events)
    with pytest.raises(ResponseEventsError):
        m.feed(content("more"))
    with pytest.raises(ResponseEventsError):
        m.finish()


def test_a_non_streamed_completion_gives_the_streams_final_response() -> None:
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Looking.",
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x":1}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": USAGE,
    }
    request = validate_request({"model": "tiny", "input": "hi"})
    response = response_from_completion(
        initial_response(request, response_id="resp_1", created_at=CREATED_AT),
        completion,
        new_message_id=counter("msg_"),
        new_call_item_id=counter("fc_"),
        clock=lambda: DONE_AT,
    )
    streamed = run(
        machine(),
        [
            content("Looking."),
            call(0, '{"x":1}', call_id="call_a", name="f"),
            finish("tool_calls"),
            usage(),
        ],
    )
    assert response == streamed[-1]["response"]
    typed = Response.model_validate(response, strict=True)
    no_unknown_fields(typed)
    assert typed.output_text == "Looking."


def test_usage_carried_from_an_earlier_attempt_moves_from_input_to_output() -> None:
    assert response_usage(USAGE, carried_output_tokens=3) == {
        "input_tokens": 17,
        "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 24,
    }


# Resuming from the stored events.


def test_a_retried_generation_continues_the_stored_stream() -> None:
    first = machine({"model": "tiny", "input": "hi", "background": True}, hold_calls=True)
    stored = (
        first.created()
        + first.in_progress()
        + first.feed(content("Hello"))
        + first.feed(content(" wor"))
    )
    # The process dies here; a retry rebuilds the machine from what was stored.
    resumed = ResponseEvents.resume(
        stored, new_message_id=counter("msg_new"), clock=lambda: DONE_AT
    )
    assert resumed.next_sequence_number == len(stored)
    assert resumed.partial_text == "Hello wor"
    assert resumed.carried_output_tokens == 2  # one per stored delta
    assert not resumed.terminal
    # llama.cpp echoes the prefix it was asked to continue.
    more = resumed.start()
    assert more == []  # created and in_progress were sent before
    more += resumed.feed(content("Hello wor"))
    more += resumed.feed(content("ld!"))
    more += resumed.feed(finish("stop")) + resumed.feed(usage()) + resumed.finish()
    assert more[0]["sequence_number"] == stored[-1]["sequence_number"] + 1
    assert {e["item_id"] for e in more if "item_id" in e} == {"msg_1"}
    whole = stored + more
    added = [e["item"]["id"] for e in whole if e["type"] == "response.output_item.added"]
    assert added == ["msg_1"]  # the open item went on; nothing was added twice
    final = client_final(whole)
    assert final.output_text == "Hello world!"
    assert final_response(whole).usage is not None
    usage_now = final_response(whole).usage
    assert usage_now is not None
    assert (usage_now.input_tokens, usage_now.output_tokens) == (18, 6)


def test_a_resumed_stream_after_a_completed_call_adds_new_items_after_it() -> None:
    first = machine(hold_calls=True)
    stored = run(first, [call(0, "{}", call_id="call_a", name="f"), content("Now")], end=False)
    resumed = ResponseEvents.resume(stored, new_message_id=counter("msg_r"))
    assert resumed.partial_text == "Now"
    # An engine that does not echo (vLLM) sends only new text.
    more = resumed.feed(content(" then")) + resumed.feed(finish("stop")) + resumed.finish()
    final = client_final(stored + more)
    assert [o.type for o in final.output] == ["function_call", "message"]
    assert final.output_text == "Now then"
    ids = [e["item"]["id"] for e in stored + more if e["type"] == "response.output_item.added"]
    assert len(ids) == len(set(ids)) == 2


def test_a_queued_log_resumes_with_in_progress_next() -> None:
    first = machine({"model": "tiny", "input": "hi", "background": True})
    stored = first.created()
    resumed = ResponseEvents.resume(stored)
    more = run(resumed, [content("x"), finish("stop")])
    assert types(more)[0] == "in_progress"
    assert more[0]["sequence_number"] == 1
    assert client_final(stored + more).output_text == "x"


def test_a_finished_log_resumes_terminal() -> None:
    stored = run(machine(), [content("x"), finish("stop")])
    resumed = ResponseEvents.resume(stored)
    assert resumed.terminal
    assert resumed.response == stored[-1]["response"]
    with pytest.raises(ResponseEventsError):
        resumed.feed(content("y"))


def test_logs_that_cannot_be_resumed() -> None:
    stored = run(machine(), [call(0, '{"x":', call_id="call_a", name="f")], end=False)
    with pytest.raises(NotResumable, match="left open"):
        ResponseEvents.resume(stored)  # a call streamed unheld cannot be continued
    text = run(machine(), [content("a"), content("b")], end=False)
    with pytest.raises(NotResumable, match="sequence_number"):
        ResponseEvents.resume(text[:3] + text[4:])
    with pytest.raises(NotResumable):
        ResponseEvents.resume(text[1:])
    with pytest.raises(NotResumable):
        ResponseEvents.resume([])
