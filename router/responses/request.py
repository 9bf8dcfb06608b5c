"""The body of ``POST /v1/responses`` that llmgw accepts, validated.

A bad body fails pydantic validation with the field at fault in the error's
``loc`` (the router turns it into OpenAI's 400 naming that ``param``).

What is accepted, refused and ignored:

- **Unknown top-level fields are refused** (``extra="forbid"``), as OpenAI's
  API answers ``Unknown parameter``: a misspelt ``max_output_token`` would
  otherwise be silently dropped.
- **Fields inside items, parts and tools are tolerated**: a client replays a
  previous response's output as input, and those items carry fields this
  version does not read (``annotations``, ``logprobs``, ``phase``...).
- **Accepted and ignored**, because honouring them changes nothing a client
  can see from a self-hosted engine: ``include``,
  ``prompt_cache_retention``, ``safety_identifier``, ``service_tier``,
  ``stream_options``, ``reasoning``, ``max_tool_calls``, ``text.verbosity``
  and ``truncation: "disabled"`` (the default).
- ``prompt_cache_key`` is passed on: the router's cache-aware routing
  keeps the requests that share it together (docs/guides/routing.md).
- **Refused with a clear error**: tools other than ``function``, input items
  other than messages, ``function_call`` and ``function_call_output`` (an
  ``item_reference`` too: resolving one needs the store), ``input_file``
  parts and images by ``file_id``, ``conversation``, ``prompt``,
  ``truncation: "auto"``, ``top_logprobs`` above 0, ``background`` without
  ``store``, a ``tool_choice`` naming a function not in ``tools``.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from llmgw.errors import LlmgwError
from router.common.metadata import Metadata

# Function and schema names, as OpenAI constrains them.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"

ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text", "refusal", "input_image")
FORMAT_TYPES = ("text", "json_object", "json_schema")
# The labels pydantic puts in an error's loc for the member of a union it
# tried: a tag follows a list index (an item, a part) or ``format``.
_TAGS = frozenset(ITEM_TYPES + PART_TYPES + FORMAT_TYPES)
_ELEMENT = re.compile(r"^\[(\d+)\]: (.*)$", re.DOTALL)
# Errors that only say "not the other member of str | list".
_MEMBER_MISMATCH = frozenset({"string_type", "list_type"})


class RequestInvalid(LlmgwError):
    """A body llmgw refuses: ``param`` names the field at fault (OpenAI's path
    notation, ``input[0].content``), ``message`` every problem found."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _type_of(value: Any, default: str | None = None) -> Any:
    if isinstance(value, dict):
        return value.get("type", default)
    return getattr(value, "type", default)


def _refuse_unknown_types(
    values: Any, known: tuple[str, ...], what: str, default: str | None
) -> Any:
    """``values`` unchanged, when every element's ``type`` is one of ``known``
    (checked before the typed parse so the error names the type at fault)."""
    if isinstance(values, list):
        for i, value in enumerate(values):
            kind = _type_of(value, default)
            if isinstance(value, dict) and kind not in known:
                accepted = ", ".join(known)
                raise ValueError(
                    f"[{i}]: {what} type {kind!r} is not supported; llmgw accepts {accepted}"
                )
    return values


class _Tolerant(BaseModel):
    # Items, parts and tools replayed from OpenAI's own output carry fields
    # this version does not read: ignored, so a client can send back what it got.
    model_config = ConfigDict(extra="ignore")


class InputText(_Tolerant):
    type: Literal["input_text"]
    text: str


class OutputText(_Tolerant):
    type: Literal["output_text"]
    text: str


class Refusal(_Tolerant):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Tolerant):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None

    @field_validator("file_id")
    @classmethod
    def _no_file_id(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("images by file_id are not supported; give image_url")
        return value

    @field_validator("image_url")
    @classmethod
    def _url_given(cls, value: str | None) -> str | None:
        if not value:
            raise ValueError("an input_image needs an image_url")
        return value


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")]
    | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")]
    | Annotated[InputImage, Tag("input_image")],
    Discriminator(_type_of),
]


def _parts(value: Any) -> Any:
    return _refuse_unknown_types(value, PART_TYPES, "content part", None)


class MessageItem(_Tolerant):
    """A message: ``EasyInputMessage``, ``Message`` or an assistant's output message
    replayed (its ``type`` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        return _parts(value)


class FunctionCallItem(_Tolerant):
    """A call the model made, replayed as input."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Tolerant):
    """The caller's answer to a function call, matched by ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        return _parts(value)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    # A message may leave out its type (EasyInputMessage).
    Discriminator(lambda value: _type_of(value, "message")),
]
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem

_ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[InputItem])


def parse_items(raw: list[Any]) -> list[Item]:
    """Stored items (a previous response's input and output, as JSON) as typed items."""
    return _ITEMS.validate_python(_refuse_unknown_types(raw, ITEM_TYPES, "input item", "message"))


class FunctionTool(_Tolerant):
    """A function the model may call (OpenAI's flat shape, not chat's nested one)."""

    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Tolerant):
    type: Literal["function"]
    name: str = Field(min_length=1)


class FormatText(_Tolerant):
    type: Literal["text"]


class FormatJSONObject(_Tolerant):
    type: Literal["json_object"]


class FormatJSONSchema(_Tolerant):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=NAME_PATTERN)
    # ``schema`` would shadow BaseModel.schema: the field is renamed, the wire keeps it.
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    Annotated[FormatText, Tag("text")]
    | Annotated[FormatJSONObject, Tag("json_object")]
    | Annotated[FormatJSONSchema, Tag("json_schema")],
    Discriminator(_type_of),
]


class TextConfig(_Tolerant):
    format: TextFormat = Field(default_factory=lambda: FormatText(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("format", mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        kind = _type_of(value)
        if isinstance(value, dict) and kind not in FORMAT_TYPES:
            raise ValueError(
                f"text format {kind!r} is not supported; llmgw accepts text, "
                "json_object, json_schema"
            )
        return value


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: what llmgw honours (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a served model id (GET /v1/models)")
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    metadata: Metadata | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1)
    stream: bool = False
    background: bool = False
    user: str | None = None
    # Accepted and ignored (the module's docstring says why).
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    truncation: Literal["disabled"] | None = None
    top_logprobs: Literal[0] | None = None
    # Refused when given (they need server-side state llmgw does not keep).
    conversation: Any = None
    prompt: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        return _refuse_unknown_types(value, ITEM_TYPES, "input item", "message")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = _type_of(tool)
                if isinstance(tool, dict) and kind != "function":
                    raise ValueError(
                        f"[{i}]: tool type {kind!r} is not supported; llmgw serves "
                        "function tools only"
                    )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(
                f"tool_choice type {value.get('type')!r} is not supported; give none, auto, "
                "required or {type: function, name}"
            )
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(
        cls, value: Literal["none", "auto", "required"] | ToolChoiceFunction, info: ValidationInfo
    ) -> Literal["none", "auto", "required"] | ToolChoiceFunction:
        tools: list[FunctionTool] = info.data.get("tools", [])
        if isinstance(value, ToolChoiceFunction) and value.name not in {t.name for t in tools}:
            raise ValueError(f"the function {value.name!r} is not among the tools")
        if value == "required" and not tools:
            raise ValueError("'required' needs tools")
        return value

    @field_validator("background")
    @classmethod
    def _stored_if_background(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("store") is False:
            raise ValueError("a background response must be stored: store cannot be false")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported; send the input items")
        return value

    def items(self) -> list[Item]:
        """This request's input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def validate_request(body: bytes | str | dict[str, Any]) -> ResponsesRequest:
    """``body`` parsed, or :class:`RequestInvalid` naming the field at fault
    (pydantic's own locs name the union members it tried)."""
    try:
        if isinstance(body, dict):
            return ResponsesRequest.model_validate(body)
        return ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(exc.errors()) from None


def _invalid(errors: list[ErrorDetails]) -> RequestInvalid:
    if errors and errors[0]["type"] == "json_invalid":
        return RequestInvalid("We could not parse the JSON body of your request.", None)
    if errors and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
        return RequestInvalid("The body must be a JSON object.", None)
    # A list given for ``str | list`` also fails the str member: that error
    # says nothing when the list member has its own.
    meaningful = [e for e in errors if e["type"] not in _MEMBER_MISMATCH] or errors
    problems, params = [], []
    for error in meaningful:
        param, message = param_path(error["loc"]), error["msg"].removeprefix("Value error, ")
        # Our own refusals of an element's type say which element: ``[2]: ...``.
        element = _ELEMENT.match(message)
        if element:
            param, message = f"{param}[{element[1]}]", element[2]
        params.append(param)
        problems.append(f"{param}: {message}" if param else message)
    return RequestInvalid("Invalid request: " + "; ".join(problems), params[0] or None)


def param_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic loc as OpenAI names a param (``input[0].content[1].text``),
    without the union members pydantic names in it."""
    path = ""
    previous: int | str | None = None
    for part in loc:
        member = isinstance(part, str) and (
            part == "str"
            or "[" in part
            or (part in _TAGS and (isinstance(previous, int) or previous == "format"))
        )
        if isinstance(part, int):
            path += f"[{part}]"
        elif not member:
            path += f".{part}" if path else part
        previous = part
    return path
