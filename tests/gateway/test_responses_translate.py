"""The Responses create body (router/responses/request.py) and its translation to
chat completions (router/responses/translate.py): pure, no engine.

The bodies are the ones the official openai client sends (captured through an
httpx MockTransport), so what llmgw accepts is what the client writes.
"""

import json
from typing import Any

import httpx2
import pytest
from openai import OpenAI
from openai.types.responses import Response

from router.responses import ids
from router.responses.request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    RequestInvalid,
    param_path,
    parse_items,
    validate_request,
)
from router.responses.translate import (
    PrefixStripper,
    chat_body,
    continuation_body,
    strip_prefix,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def sent_by_client(**params: Any) -> dict[str, Any]:
    """The JSON body ``client.responses.create(**params)`` sends."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        bodies.append(json.loads(request.content))
        return httpx2.Response(400, json={"error": {"message": "captured", "type": "x"}})

    client = OpenAI(
        api_key="k",
        base_url="http://llmgw.test/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    with pytest.raises(Exception, match="captured"):
        client.responses.create(**params)
    return bodies[0]


def refused(body: dict[str, Any] | bytes) -> RequestInvalid:
    with pytest.raises(RequestInvalid) as caught:
        validate_request(body)
    return caught.value


# The request.


def test_the_clients_body_with_every_field_llmgw_honours_is_accepted() -> None:
    body = sent_by_client(
        model="tiny",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        instructions="Be brief.",
        max_output_tokens=64,
        temperature=0.5,
        top_p=0.9,
        metadata={"job": "7"},
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        store=False,
        previous_response_id="resp_prev",
        stream=False,
        user="u1",
    )
    request = validate_request(json.dumps(body))
    assert request.model == "tiny"
    assert request.store is False
    assert request.background is False
    assert request.tools[0].name == "get_weather"
    assert request.text.format.type == "json_schema"
    assert request.items() == [
        MessageItem.model_validate(
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        )
    ]


def test_defaults_a_string_input_and_the_harmless_fields_ignored() -> None:
    body = sent_by_client(
        model="tiny",
        input="hello",
        include=["message.output_text.logprobs"],
        prompt_cache_key="k",
        safety_identifier="s",
        service_tier="auto",
        truncation="disabled",
        reasoning={"effort": "low"},
    )
    request = validate_request(body)
    assert request.store is True  # OpenAI's default
    assert request.stream is False
    assert request.parallel_tool_calls is True
    assert request.tool_choice == "auto"
    assert request.text.format.type == "text"
    assert request.items() == [MessageItem(role="user", content="hello")]


def test_a_previous_responses_output_is_accepted_back_as_input() -> None:
    # What the client parsed from a response (extra fields included) goes back
    # as input, the way agent loops build the next turn.
    output = Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 1,
            "model": "tiny",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "output": [
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
                },
                {
                    "id": "fc_1",
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                    "status": "completed",
                },
            ],
        }
    ).output
    body = sent_by_client(
        model="tiny",
        input=[
            *[item.model_dump(exclude_none=True) for item in output],
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[WEATHER],
    )
    items = validate_request(body).items()
    assert [type(i) for i in items] == [MessageItem, FunctionCallItem, FunctionCallOutputItem]
    assert parse_items(body["input"]) == items


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"model": "m", "input": "x", "max_output_token": 5}, "max_output_token", "Extra inputs"),
        ({"model": "m"}, "input", "Field required"),
        ({"model": "", "input": "x"}, "model", "at least 1"),
        (
            {"model": "m", "input": [{"role": "user", "content": "a"}, {"type": "computer_call"}]},
            "input[1]",
            "input item type 'computer_call' is not supported",
        ),
        (
            {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]},
            "input[0]",
            "'item_reference' is not supported",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0]",
            "content part type 'input_file' is not supported",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
            "Field required",
        ),
        (
            {"model": "m", "input": [{"role": "tool", "content": "x"}]},
            "input[0].role",
            "Input should be",
        ),
        (
            {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
            "input[0].call_id",
            "Field required",
        ),
        (
            {"model": "m", "input": "x", "tools": [WEATHER, {"type": "web_search"}]},
            "tools[1]",
            "tool type 'web_search' is not supported; llmgw serves function tools only",
        ),
        (
            {"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "'nope' is not among the tools",
        ),
        ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"model": "m", "input": "x", "tool_choice": {"type": "web_search_preview"}},
            "tool_choice",
            "not supported",
        ),
        (
            {"model": "m", "input": "x", "text": {"format": {"type": "grammar"}}},
            "text.format",
            "text format 'grammar' is not supported",
        ),
        (
            {
                "model": "m",
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}},
            },
            "text.format.name",
            "pattern",
        ),
        (
            {"model": "m", "input": "x", "background": True, "store": False},
            "background",
            "must be stored",
        ),
        ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation", "not supported"),
        ({"model": "m", "input": "x", "truncation": "auto"}, "truncation", "disabled"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater"),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature", "less than"),
        ({"model": "m", "input": "x", "metadata": {"k" * 65: "v"}}, "metadata", "longer than"),
        (
            {"model": "m", "input": "x", "metadata": {str(i): "v" for i in range(17)}},
            "metadata",
            "at most 16",
        ),
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
            },
            "input[0].content[0].file_id",
            "give image_url",
        ),
    ],
)
def test_a_refused_body_names_the_field_at_fault(
    body: dict[str, Any], param: str, says: str
) -> None:
    error = refused(body)
    assert error.param == param
    assert says in error.message
    assert error.message.startswith("Invalid request: ")


def test_a_body_that_is_not_a_json_object() -> None:
    assert refused(b"{").param is None
    assert "JSON" in refused(b"{").message
    assert refused(b"[1]").message == "The body must be a JSON object."


def test_param_paths_drop_the_union_members_pydantic_names() -> None:
    loc = ("input", "list[tagged-union[A,B]]", 0, "message", "content", "list[x]", 1, "input_text")
    assert param_path(loc) == "input[0].content[1]"
    assert param_path(("text", "format", "json_schema", "name")) == "text.format.name"
    # A field called like a tag is kept where it is a field.
    assert param_path(("input", 0, "input_text", "text")) == "input[0].text"


# The translation.


def test_a_multi_turn_conversation_with_function_calls_as_chat_messages() -> None:
    history = parse_items(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city":"Rome"}',
            },
        ]
    )
    request = validate_request(
        {
            "model": "tiny",
            "instructions": "Be brief.",
            "input": [
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
                {"role": "developer", "content": "Answer in one line."},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Thanks."},
                        {"type": "input_text", "text": "Which is warmer?"},
                    ],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": "auto",
        }
    )
    body = chat_body(request, history)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Thanks.\nWhich is warmer?"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert body["tool_choice"] == "auto"
    assert body["parallel_tool_calls"] is True


def test_a_call_without_text_before_it_is_its_own_assistant_message() -> None:
    request = validate_request(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
            ],
        }
    )
    assert chat_body(request)["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "1"},
    ]


def test_the_sampling_fields_format_and_stream_map_to_chat() -> None:
    request = validate_request(
        {
            "model": "tiny",
            "input": "hi",
            "max_output_tokens": 32,
            "temperature": 0.2,
            "top_p": 0.5,
            "user": "u",
            "metadata": {"a": "b"},
            "stream": True,
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "answer",
                    "schema": {"type": "object", "required": ["a"]},
                    "strict": True,
                }
            },
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    body = chat_body(request)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 32
    assert (body["temperature"], body["top_p"], body["user"]) == (0.2, 0.5, "u")
    assert "metadata" not in body
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "required": ["a"]},
            "strict": True,
        },
    }
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    # A background run streams whatever the client asked.
    assert chat_body(request, stream=False)["stream"] is False
    assert "stream_options" not in chat_body(request, stream=False)


def test_plain_text_and_json_object_formats_and_no_tools() -> None:
    plain = chat_body(validate_request({"model": "m", "input": "hi"}))
    assert plain == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
    }
    json_object = validate_request(
        {"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}}
    )
    assert chat_body(json_object)["response_format"] == {"type": "json_object"}


def test_an_image_part_keeps_the_content_typed() -> None:
    request = validate_request(
        {
            "model": "m",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
                    ],
                }
            ],
        }
    )
    assert chat_body(request)["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            ],
        }
    ]


# Continuing a partial answer (a retried background generation).


def test_a_continuation_ends_with_the_partial_assistant_text() -> None:
    body = chat_body(validate_request({"model": "m", "input": "hi", "max_output_tokens": 50}))
    continued = continuation_body(body, "Hello wor", max_tokens=46)
    assert continued["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello wor"},
    ]
    assert continued["continue_final_message"] is True
    assert continued["add_generation_prompt"] is False
    assert continued["max_tokens"] == 46
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # left as it was
    assert body["max_tokens"] == 50


def test_a_continuation_joins_a_final_assistant_message_rather_than_adding_one() -> None:
    # Engines refuse two assistant messages at the end.
    body = chat_body(
        validate_request(
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": "Count"},
                    {"role": "assistant", "content": "1, 2"},
                ],
            }
        )
    )
    continued = continuation_body(body, ", 3")
    assert continued["messages"][-1] == {"role": "assistant", "content": "1, 2, 3"}
    assert len(continued["messages"]) == 2
    assert body["messages"][-1]["content"] == "1, 2"


def test_an_echoed_prefix_is_stripped_and_new_text_kept() -> None:
    # llama.cpp's answer starts with the prefix; vLLM's does not.
    assert strip_prefix("Hello wor by after", "Hello wor") == " by after"
    assert strip_prefix("ld, bye", "Hello wor") == "ld, bye"
    assert strip_prefix("anything", "") == "anything"


@pytest.mark.parametrize(
    ("deltas", "passed"),
    [
        (["Hello wor by", " after"], " by after"),  # llama.cpp: the echo in the first delta
        (["Hel", "lo w", "or", "ld"], "ld"),  # the echo spread over deltas
        (["ld", ", bye"], "ld, bye"),  # vLLM: no echo
        (["Hel", "p!"], "Help!"),  # looked like the echo, then departed from it
        (["Hell"], "Hell"),  # ended while it could still have been the echo
    ],
)
def test_the_stream_prefix_stripper(deltas: list[str], passed: str) -> None:
    stripper = PrefixStripper("Hello wor")
    out = "".join(stripper.feed(d) for d in deltas) + stripper.flush()
    assert out == passed


def test_ids_have_openais_shapes_and_differ() -> None:
    assert ids.response_id().startswith("resp_")
    assert len(ids.response_id()) == len("resp_") + 48
    assert len(ids.message_id()) == len("msg_") + 32
    assert ids.function_call_id().startswith("fc_")
    assert ids.function_call_output_id().startswith("fco_")
    call = ids.call_id()
    assert call.startswith("call_")
    assert call[5:].isalnum()
    assert len(call) == len("call_") + 24
    assert len({ids.message_id() for _ in range(100)}) == 100
