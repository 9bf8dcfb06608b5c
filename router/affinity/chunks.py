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

A cache scope (router/affinity/scope.py) other than ``shared`` seeds the
chain with its id: two scopes' digests of one prompt differ from its first
chunk on, so nothing one scope sent is ever found held for another, and its
lead (where a new conversation goes, which slot it takes) is drawn afresh.
The shared scope's chain starts where it always did.

Digests are blake2b, never Python's ``hash()``: that is salted per process,
and routers that never talked must compute the same digests; routers of two
versions too, during an upgrade (tests/gateway/test_affinity_chunk_values.py
holds the values): make it faster, not different.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

# Estimated characters per token: prompts are not tokenized in the router.
CHARS_PER_TOKEN = 4
# Roles an engine renders before the conversation proper: the conversation's
# lead (its rendezvous key) runs through the first chunk of another role's
# first message, so what differs between conversations is in it, and what
# they share (a system prompt, tools) is before it.
SYSTEM_ROLES = frozenset({"system", "developer"})
_SEED = 0x6C6C6D6777  # the chain's start ("llmgw"): an empty prefix
_blake2b = hashlib.blake2b


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
    # One call on the joined bytes: the digest of update(a); update(b), cheaper.
    h = _blake2b(previous.to_bytes(8, "big") + content, digest_size=8)
    return int.from_bytes(h.digest(), "big")


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` estimated from its length (at least one)."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def scope_seed(scope: str) -> int:
    """Where the chain of a prompt in cache scope ``scope`` starts ("": shared)."""
    if not scope:
        return _SEED
    return digest(_SEED, b"scope\0" + scope.encode())


def prompt_key(
    body: Mapping[str, object], chunk_tokens: int, sticky: str | None = None, scope: str = ""
) -> PromptKey | None:
    """The key of a chat or completions request body in cache scope ``scope``
    ("": shared); None when it has no single text prompt (embeddings,
    token-id prompts, several prompts)."""
    seed = scope_seed(scope)
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chat_key(body, messages, chunk_tokens, sticky, seed)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and "input" not in body:
        chunks: list[Chunk] = []
        _chain(seed, prompt, max(1, chunk_tokens) * CHARS_PER_TOKEN, chunks)
        return _key(tuple(chunks), 1, sticky, seed)
    return None


def _chat_key(
    body: Mapping[str, object],
    messages: list[object],
    chunk_tokens: int,
    sticky: str | None,
    seed: int = _SEED,
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
    previous = seed
    size = max(1, chunk_tokens) * CHARS_PER_TOKEN
    for i, text in enumerate(texts):
        if i == lead_at:
            lead = len(chunks) + 1  # the first chunk of that message
        previous = _chain(previous, text, size, chunks)
    return _key(tuple(chunks), lead or len(chunks), sticky, seed)


def _key(chunks: tuple[Chunk, ...], lead: int, sticky: str | None, seed: int = _SEED) -> PromptKey:
    """The key of ``chunks`` whose lead is the chunk numbered ``lead`` (from one)."""
    if sticky is None:
        lead_digest = chunks[lead - 1].digest
    else:
        lead_digest = digest(seed, b"sticky\0" + sticky.encode())
    total = head = 0
    for i, chunk in enumerate(chunks):
        if i == lead - 1:
            head = total
        total += chunk.tokens
    return PromptKey(chunks, lead_digest, sticky, total, head)


def _chain(previous: int, text: str, size: int, out: list[Chunk]) -> int:
    """Append to ``out`` the chunks of ``text`` chained after ``previous``:
    one, or fixed pieces of ``size`` characters when it is longer; the last
    digest. Text is encoded once (the pieces of ASCII text are its bytes')."""
    data = text.encode()
    length = len(text)
    if length <= size:  # the common case: one chunk
        previous = digest(previous, data)
        out.append(Chunk(previous, max(1, -(-length // CHARS_PER_TOKEN))))
        return previous
    ascii_ = len(data) == length  # UTF-8: one byte a character only then
    for start in range(0, length, size):
        end = min(start + size, length)
        piece = data[start:end] if ascii_ else text[start:end].encode()
        previous = digest(previous, piece)
        out.append(Chunk(previous, max(1, -(-(end - start) // CHARS_PER_TOKEN))))
    return previous


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
    if len(message) == ("role" in message) + ("content" in message):
        return f"{role}\0{text}"  # the common case: nothing else in it
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    return f"{role}\0{text}\0{_canonical(rest)}"


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
