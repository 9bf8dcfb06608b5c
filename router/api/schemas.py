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
    # The fields that bound what an engine generates: what a request reserves
    # of its key's token quota (router.api.reservation.reserved_tokens).
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's newer name; llama.cpp and vLLM obey it on both endpoints.
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n_predict: int | None = Field(
        default=None,
        ge=-1,
        description="llama.cpp: wins over max_tokens; -1 generates until the context is full",
    )
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    n_cmpl: int | None = Field(default=None, ge=1, le=128, description="llama.cpp's n")
    best_of: int | None = Field(
        default=None, ge=1, le=128, description="sequences generated, n of them returned"
    )
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)

    def wants_usage(self) -> bool:
        """Whether the client asked for the usage chunk of a stream."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def unbounded(self) -> bool:
        """Whether the client asked for generation until the context is full."""
        return self.n_predict == -1

    def completion_limit(self) -> int | None:
        """The most tokens the engine may generate per choice, when the client bounds it.

        Engines disagree on which field wins (llama.cpp: ``n_predict``, then
        ``max_completion_tokens``, then ``max_tokens``; vLLM ignores
        ``n_predict``), so the largest counts. llama.cpp generates one token
        for an ``n_predict`` of 0.
        """
        if self.unbounded():
            return None
        fields = (self.max_tokens, self.max_completion_tokens, self.n_predict)
        given = [x for x in fields if x is not None]
        return max(1, *given) if given else None

    def prompts(self) -> int:
        """How many prompts are completed (each ``choices`` times)."""
        return 1

    def choices(self) -> int:
        """Sequences the engine generates for each prompt."""
        return max(self.n or 1, self.n_cmpl or 1, self.best_of or 1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)

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

    def prompts(self) -> int:
        """How many prompts: a list of strings or of token id lists is a batch."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return 1
        return len(p)

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


# What a request that does not bound its generation costs in the queue, per
# choice (its quota reservation assumes the whole context instead).
DEFAULT_COMPLETION_COST = 256


def queue_cost(body: object, prompt_estimate: int) -> int:
    """A request's cost for fair queuing, in tokens: the prompt estimate plus
    what it asks to generate (or a default) for every choice and prompt."""
    if not isinstance(body, _Generation):
        return prompt_estimate  # embeddings
    limit = body.completion_limit() or DEFAULT_COMPLETION_COST
    return prompt_estimate + limit * body.choices() * body.prompts()
