"""Prompt keys (router/affinity/chunks.py): chunks, chained digests, the lead."""

import json
import os
import subprocess
import sys
from collections.abc import Mapping

from router.affinity.chunks import CHARS_PER_TOKEN, PromptKey, prompt_key

SYSTEM = {"role": "system", "content": "You are terse. " * 40}


def _chat(*messages: Mapping[str, object], **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": list(messages), **extra}


def _key(body: dict[str, object], chunk_tokens: int = 256, sticky: str | None = None) -> PromptKey:
    key = prompt_key(body, chunk_tokens, sticky)
    assert key is not None
    return key


def test_one_chunk_per_message_and_fixed_chunks_inside_long_ones() -> None:
    long_text = "x" * (100 * CHARS_PER_TOKEN * 3 + 7)  # three whole chunks and a bit
    short = {"role": "system", "content": "terse"}
    key = _key(_chat(short, {"role": "user", "content": long_text}), chunk_tokens=100)
    assert len(key.chunks) == 1 + 4
    assert [c.tokens for c in key.chunks[1:4]] == [100, 100, 100]
    assert 1 <= key.chunks[4].tokens < 100
    assert key.prompt_tokens == sum(c.tokens for c in key.chunks)
    assert all(c.tokens >= 1 for c in key.chunks)


def test_digests_are_chained_a_changed_message_changes_every_later_one() -> None:
    turns = [{"role": "user", "content": f"question {i}"} for i in range(4)]
    base = _key(_chat(SYSTEM, *turns))
    edited = _key(_chat(SYSTEM, turns[0], {"role": "user", "content": "other"}, *turns[2:]))
    assert base.chunks[:2] == edited.chunks[:2]
    assert all(
        a.digest != b.digest for a, b in zip(base.chunks[2:], edited.chunks[2:], strict=True)
    )
    # The same later message after another history is another chunk.
    assert base.chunks[-1].digest != _key(_chat(turns[-1])).chunks[-1].digest


def test_a_longer_conversation_extends_the_shorter_ones_chain() -> None:
    first = _key(_chat(SYSTEM, {"role": "user", "content": "hi"}))
    second = _key(
        _chat(
            SYSTEM,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        )
    )
    assert second.chunks[: len(first.chunks)] == first.chunks
    assert second.lead == first.lead  # the conversation's rendezvous key stays


def test_the_lead_runs_through_the_first_non_system_message() -> None:
    a = _key(_chat(SYSTEM, {"role": "user", "content": "conversation A"}))
    b = _key(_chat(SYSTEM, {"role": "user", "content": "conversation B"}))
    assert a.chunks[0] == b.chunks[0]  # the shared system prompt
    assert a.lead != b.lead  # but two conversations spread over replicas
    assert a.lead == a.chunks[1].digest
    assert a.head_tokens == a.chunks[0].tokens  # what precedes the lead: the system prompt
    only_system = _key(_chat(SYSTEM))
    assert only_system.lead == only_system.chunks[-1].digest


def test_the_lead_is_the_first_chunk_of_a_long_first_message() -> None:
    """Questions opening with the same long document share a lead (they meet
    on one replica); conversations that differ early do not."""
    document = "The contract says. " * 200  # ~950 tokens: several chunks
    q1 = _key(_chat(SYSTEM, {"role": "user", "content": document + "Who signs?"}))
    q2 = _key(_chat(SYSTEM, {"role": "user", "content": document + "When?"}))
    assert q1.lead == q2.lead == q1.chunks[1].digest
    assert q1.chunks[-1] != q2.chunks[-1]
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = _key(_chat({"role": "user", "content": "hi"}, tools=tools))
    assert with_tools.lead == with_tools.chunks[1].digest
    assert with_tools.head_tokens == with_tools.chunks[0].tokens
    assert _key(_chat({"role": "user", "content": "hi"})).head_tokens == 0


def test_a_sticky_key_is_the_lead_whatever_the_prompt() -> None:
    a = _key(_chat({"role": "user", "content": "one"}), sticky="session:s1")
    b = _key(_chat({"role": "user", "content": "two"}), sticky="session:s1")
    c = _key(_chat({"role": "user", "content": "one"}), sticky="session:s2")
    assert a.lead == b.lead != c.lead
    assert a.sticky == "session:s1"
    assert a.chunks == c.chunks  # the chunks are the prompt's alone


def test_content_parts_tool_calls_and_tools_are_part_of_the_prompt() -> None:
    text = _key(_chat({"role": "user", "content": "look"}))
    parts = _key(_chat({"role": "user", "content": [{"type": "text", "text": "look"}]}))
    assert text.chunks == parts.chunks  # one text part is the same prompt as a string
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    other = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}
    with_a = _key(_chat({"role": "user", "content": [{"type": "text", "text": "look"}, image]}))
    with_b = _key(_chat({"role": "user", "content": [{"type": "text", "text": "look"}, other]}))
    assert len({text.chunks, with_a.chunks, with_b.chunks}) == 3
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = _key(_chat({"role": "assistant", "content": None, "tool_calls": [call]}))
    other_call = {**call, "function": {"name": "g", "arguments": "{}"}}
    assert called.chunks != _key(_chat({"role": "assistant", "tool_calls": [other_call]})).chunks
    # Key order inside a tool call does not matter (canonical JSON).
    reordered = {"function": {"arguments": "{}", "name": "f"}, "type": "function", "id": "c1"}
    assert called.chunks == _key(_chat({"role": "assistant", "tool_calls": [reordered]})).chunks
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert _key(_chat({"role": "user", "content": "look"}, tools=[tool])).chunks != text.chunks
    # Roles are part of the text: the same words as system or user differ.
    assert _key(_chat({"role": "system", "content": "look"})).chunks != text.chunks


def test_completions_prompt_and_what_has_no_key() -> None:
    one = _key({"model": "m", "prompt": "Once upon a time"})
    assert one.chunks == _key({"model": "m", "prompt": ["Once upon a time"]}).chunks
    assert one.lead == one.chunks[0].digest and one.head_tokens == 0
    for body in (
        {"model": "m", "input": "embed me"},  # embeddings
        {"model": "m", "prompt": [1, 2, 3]},  # token ids
        {"model": "m", "prompt": ["a", "b"]},  # several prompts
        {"model": "m", "prompt": [[1, 2]]},
        {"model": "m"},
        {"model": "m", "messages": ["not a message"]},
    ):
        assert prompt_key(body, 256) is None, body


def test_digests_are_the_same_in_every_process() -> None:
    """Routers that never talked agree: no per-process salt (Python's hash())."""
    body = _chat(SYSTEM, {"role": "user", "content": "same everywhere"})
    here = _key(body, sticky="user:k1:u")
    code = (
        "import json, sys\n"
        "from router.affinity.chunks import prompt_key\n"
        "k = prompt_key(json.loads(sys.argv[1]), 256, 'user:k1:u')\n"
        "print(json.dumps([k.lead, [c.digest for c in k.chunks]]))\n"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(body)],
            env=env, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert json.loads(out.stdout) == [here.lead, [c.digest for c in here.chunks]]
