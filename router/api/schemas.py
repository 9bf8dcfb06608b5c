"""Request bodies of the OpenAI endpoints: validated, documented, passed through.

The fields the router (or a typical client) relies on are typed, so a bad
value is a 400 naming the field rather than an engine error; every other
field is allowed and reaches the engine unchanged (``extra="allow"``).
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="a served model id (GET /v1/models)")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None


class _Generation(_Body):
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)

    def wants_usage(self) -> bool:
        """Whether the client asked for the usage chunk of a stream."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def completion_limit(self) -> int | None:
        """The most completion tokens the client allows, when it says."""
        return self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def completion_limit(self) -> int | None:
        """max_completion_tokens (new name) or max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def prompt_bytes(self) -> int:
        """Bytes of text in the messages (the prompt estimate's base)."""
        total = 0
        for m in self.messages:
            if isinstance(m.content, str):
                total += len(m.content.encode())
            elif m.content:
                total += sum(len(str(p.get("text", "")).encode()) for p in m.content)
        return total


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]

    def prompt_bytes(self) -> int:
        """Bytes (or token ids) of the prompt."""
        p = self.prompt
        if isinstance(p, str):
            return len(p.encode())
        return sum(len(x.encode()) if isinstance(x, str) else _ids(x) for x in p)


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: str | None = None
    dimensions: int | None = Field(default=None, ge=1)

    def inputs(self) -> int:
        """How many inputs are embedded."""
        return 1 if isinstance(self.input, str) else max(1, len(self.input))

    def prompt_bytes(self) -> int:
        """Bytes (or token ids) of the inputs."""
        i = self.input
        if isinstance(i, str):
            return len(i.encode())
        return sum(len(x.encode()) if isinstance(x, str) else _ids(x) for x in i)


def _ids(x: int | TokenIds) -> int:
    # A token id list is worth two "bytes" each: the estimate divides by two.
    return 2 if isinstance(x, int) else 2 * len(x)
