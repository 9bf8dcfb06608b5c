"""OpenAI calls the end-to-end tests make the same way against every engine."""

from collections.abc import AsyncIterable, Callable, Sequence
from typing import Protocol, TypeVar

import openai
from openai.types import CompletionUsage


class _Chunk(Protocol):
    @property
    def choices(self) -> Sequence[object]: ...
    @property
    def usage(self) -> CompletionUsage | None: ...


C = TypeVar("C", bound=_Chunk)


async def streamed_chat(
    oai: openai.AsyncOpenAI, model: str, max_tokens: int
) -> tuple[str, CompletionUsage | None]:
    """A streamed chat completion of "hi" asking for usage: its text and its usage."""
    stream = await oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    return await _text_and_usage(stream, lambda c: c.choices[0].delta.content or "")


async def streamed_completion(
    oai: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int
) -> tuple[str, CompletionUsage | None]:
    """A streamed completion of ``prompt`` asking for usage: its text and its usage."""
    stream = await oai.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    return await _text_and_usage(stream, lambda c: c.choices[0].text)


async def _text_and_usage(
    stream: AsyncIterable[C], piece: Callable[[C], str]
) -> tuple[str, CompletionUsage | None]:
    """The text of every chunk with a choice, and the usage the last chunk carried."""
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += piece(chunk)
        usage = chunk.usage or usage
    return text, usage
