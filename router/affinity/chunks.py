"""A prompt as a chain of chunk digests: what a prefix cache can share.

Chunks follow message boundaries (one per message of a chat), and a message
longer than ``chunk_tokens`` is cut into fixed pieces of that size, so two
prompts that share a long document share every whole piece of it. Digests
are chained, ``d_i = H(d_{i-1}, content_i)``: equal digests mean equal
prompts up to there, which is what an engine's prefix cache needs, so a
changed earlier message changes every later digest.

The lead, through the first chunk of the first message past the system
prompt, is what routers hash to agree on a replica for a conversation none
of them has seen: distinct conversations spread, and questions that open
with the same document (longer than a chunk) meet on one replica.

Digests are blake2b, never Python's ``hash()``: that is salted per process,
and routers that never talked must compute the same digests.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

# Estimated characters per token: prompts are not tokenized in the router.
CHARS_PER_TOKEN = 4
# Roles an engine renders before the conversation proper: the conversation's
# lead (its rendezvous key) runs through the first chunk of another role's
# first message, so what differs between conversations is in it, and what
# they share (a system prompt, tools) is before it.
SYSTEM_ROLES = frozenset({"system", "developer"})
_SEED = 0x6C6C6D6777  # the chain's start ("llmgw"): an empty prefix


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a prompt: its chained digest and its own size."""

    digest: int  # 64-bit, chained: equal digest => equal prompt through this chunk
    tokens: int  # estimated tokens of this chunk alone (>= 1)


@dataclass(frozen=True, slots=True)
class PromptKey:
    """What the router knows of a prompt's cacheable prefix."""

    chunks: tuple[Chunk, ...]
    # Rendezvous key of the conversation: the chained digest through the first
    # chunk of the first non-system message (the whole message when shorter
    # than a chunk), or of ``sticky`` when given.
    lead: int
    sticky: str | None  # "session:<v>" | "user:<v>" | None (namespaced by the caller)
    prompt_tokens: int  # estimate: the sum of the chunks' tokens
    # Tokens before that chunk (whatever ``sticky``): the head conversations
    # share (system prompt, tools), which the routing rule assumes every
    # replica holds or soon will.
    head_tokens: int = 0


def digest(previous: int, content: bytes) -> int:
    """The chained digest of ``content`` after a prefix digested as ``previous``."""
    h = hashlib.blake2b(previous.to_bytes(8, "big"), digest_size=8)
    h.update(content)
    return int.from_bytes(h.digest(), "big")


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` estimated from its length (at least one)."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def prompt_key(
    body: Mapping[str, object], chunk_tokens: int, sticky: str | None = None
) -> PromptKey | None:
    """The key of a chat or completions request body; None when it has no
    single text prompt (embeddings, token-id prompts, several prompts)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chat_key(body, messages, chunk_tokens, sticky)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and "input" not in body:
        chunks = tuple(_chain(_SEED, [prompt], chunk_tokens))
        if not chunks:
            return None
        return _key(chunks, 1, sticky)
    return None


def _chat_key(
    body: Mapping[str, object], messages: list[object], chunk_tokens: int, sticky: str | None
) -> PromptKey | None:
    texts: list[str] = []
    # Tool definitions are rendered ahead of the messages by chat templates:
    # prompts with other tools share nothing.
    if body.get("tools"):
        texts.append("tools\0" + _canonical(body.get("tools")))
    lead_at = -1
    for message in messages:
        if not isinstance(message, Mapping):
            return None
        role = str(message.get("role", ""))
        texts.append(_message_text(role, message))
        if lead_at < 0 and role not in SYSTEM_ROLES:
            lead_at = len(texts) - 1
    if not texts:
        return None
    chunks: list[Chunk] = []
    lead = 0
    for i, text in enumerate(texts):
        if i == lead_at:
            lead = len(chunks) + 1  # the first chunk of that message
        chunks.extend(_chain(chunks[-1].digest if chunks else _SEED, [text], chunk_tokens))
    return _key(tuple(chunks), lead or len(chunks), sticky)


def _key(chunks: tuple[Chunk, ...], lead: int, sticky: str | None) -> PromptKey:
    """The key of ``chunks`` whose lead is the chunk numbered ``lead`` (from one)."""
    head = chunks[:lead]
    sticky_lead = digest(_SEED, b"sticky\0" + sticky.encode()) if sticky is not None else None
    return PromptKey(
        chunks,
        head[-1].digest if sticky_lead is None else sticky_lead,
        sticky,
        sum(c.tokens for c in chunks),
        sum(c.tokens for c in head[:-1]),
    )


def _chain(previous: int, texts: list[str], chunk_tokens: int) -> Iterator[Chunk]:
    """Chunks of each text, chained after ``previous``: one per text, or
    fixed pieces of ``chunk_tokens`` when it is longer."""
    size = max(1, chunk_tokens) * CHARS_PER_TOKEN
    for text in texts:
        for start in range(0, max(1, len(text)), size):
            piece = text[start : start + size]
            previous = digest(previous, piece.encode())
            yield Chunk(previous, estimate_tokens(piece))


def _message_text(role: str, message: Mapping[object, object]) -> str:
    """A message as the text its chunks digest: role, content, the rest.

    Content parts other than text (images, audio, files) are digested as
    their canonical JSON, so another image is another prompt; tool calls and
    names likewise. The separators keep ``("ab", "c")`` apart from ``("a", "bc")``.
    """
    content = message.get("content")
    if isinstance(content, list):
        text = "\0".join(
            str(part.get("text", ""))
            if isinstance(part, Mapping) and part.get("type") == "text"
            else _canonical(part)
            for part in content
        )
    elif content is None:
        text = ""
    else:
        text = str(content)
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    return f"{role}\0{text}" + (f"\0{_canonical(rest)}" if rest else "")


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
