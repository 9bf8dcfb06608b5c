"""Prompt keys keep their values across versions (router/affinity/chunks.py).

Routers that never talked agree on a new conversation's replica through its
lead digest, and on its llama.cpp slot, so during a rolling upgrade the old
and the new router must digest a prompt alike: these are the values the
first implementation computed (commit 258b1af), whatever is made faster
since. ASCII text longer than a chunk, non-ASCII text cut inside multi-byte
characters, a message with fields besides role and content, tools, content
parts, a sticky key and a completions prompt.
"""

from router.affinity.chunks import PromptKey, prompt_key

CHAT: dict[str, object] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You are terse. " * 40},
        {"role": "user", "content": "Résumé: " + "naïve café 日本 🙂 " * 30},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:,x"}},
            ],
        },
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
}


def _key(body: dict[str, object], chunk_tokens: int, sticky: str | None = None) -> PromptKey:
    key = prompt_key(body, chunk_tokens, sticky)
    assert key is not None
    return key


def test_a_chats_digests_are_those_of_the_first_version() -> None:
    key = _key(CHAT, 16)
    assert len(key.chunks) == 23
    assert [c.tokens for c in key.chunks[:2]] == [16, 1]  # the tools, the system prompt
    assert key.chunks[0].digest == 0xD7FDFFA94FF67CD1
    assert key.chunks[1].digest == 0xB4A46FB3859FD77E
    # The system prompt in pieces (ASCII), then the user's (non-ASCII).
    assert key.chunks[11].digest == 0x83E3461D1FDE8824 and key.chunks[11].tokens == 8
    assert key.chunks[19].digest == 0x4FFDF47B356B43A3 and key.chunks[19].tokens == 12
    # The tool call, then the content parts.
    assert key.chunks[21].digest == 0xD065F83EC8863606 and key.chunks[21].tokens == 9
    assert key.chunks[22].digest == 0xE05ADF15351EB206 and key.chunks[22].tokens == 15
    assert key.lead == key.chunks[12].digest == 0xCB66E4408F10818D
    assert (key.prompt_tokens, key.head_tokens) == (333, 169)


def test_a_sticky_lead_and_a_completions_prompt_are_those_of_the_first_version() -> None:
    sticky = _key(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, 256, "session:7:s"
    )
    assert [(c.digest, c.tokens) for c in sticky.chunks] == [(0x3EC88F9128EFA5C, 2)]
    assert sticky.lead == 0xC4597655FB7905B9
    completion = _key({"model": "m", "prompt": ["Once upon a time " * 20]}, 16)
    assert [c.tokens for c in completion.chunks] == [16] * 5 + [5]
    assert completion.lead == completion.chunks[0].digest == 0xCF2E93F0DE26B65D
    assert completion.chunks[-1].digest == 0xCD5A4FABE56A6C15
    assert (completion.prompt_tokens, completion.head_tokens) == (85, 0)
