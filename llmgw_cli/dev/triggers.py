"""How the generated tiny models (tinymodel.py for llama.cpp, tinyhf.py for vLLM)
end an answer when a client asks them to, and otherwise never do.

Their random weights are tuned never to stop: a test can ask for any number of
tokens and get exactly that many. A client that needs an answer to *end* (an agent
framework that takes ``length`` for a failure) puts a trigger in the last message:

* :data:`FINISH`: the model answers :data:`FINISH_TEXT`, then end-of-sequence;
* :data:`TOOL`: it calls the function tool :data:`TOOL_NAME` (no parameters) as
  :data:`TOOL_CALL_TEXT`, the Hermes ``<tool_call>`` form llama.cpp (``--jinja``)
  and vLLM (``--tool-call-parser hermes``) parse, then end-of-sequence.

The chat template (:data:`CHAT_TEMPLATE`) repeats the last message's trigger at the
prompt's end, where it decides the next token; a plain completion's prompt ends with
it. A trigger is one token, matched in any text; what the model says after it is
spelled with tokens of its own that no text tokenizes to. All of them are appended
to the vocabulary, so no ordinary prompt's tokens or weights change.

The mechanism (:func:`append_chain_rows`) rides on the dimension both models hold
constant (``+1`` at every ordinary position, where a large negative output weight
suppresses every token that must never be sampled). A chain token's embedding is
``-CHAIN_MAGNITUDE`` there plus as much on an address dimension of its own, so at
its position the normalised residual is about ``(address - bias) * sqrt(n/2)``,
whatever the context. Its successor's output row is twice the suppression on the
bias dimension (so it beats every suppressed token, which the negative bias lifts
too) plus :data:`CHAIN_SELECT` on the predecessor's address. At an ordinary position
those rows are more suppressed than the specials, so no winner there changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]

FINISH = "<|llmgw:finish|>"
TOOL = "<|llmgw:tool|>"
FINISH_TEXT = " done"
TOOL_NAME = "llmgw_lookup"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_TEXT = _CALL_OPEN + '\n{"name": "' + TOOL_NAME + '", "arguments": {}}\n' + _CALL_CLOSE
# What each trigger makes a model say, as text, piece by piece (end-of-sequence
# follows). The tool call's tags are pieces of their own, as parsers look for them.
CHAIN_TEXT: dict[str, tuple[str, ...]] = {
    FINISH: (FINISH_TEXT,),
    TOOL: (_CALL_OPEN, TOOL_CALL_TEXT[len(_CALL_OPEN) : -len(_CALL_CLOSE)], _CALL_CLOSE),
}

CHAIN_MAGNITUDE = 1000.0
CHAIN_SELECT = 100.0

# Plain chatml for string contents (the text it always was); branches for what an
# ordinary prompt never had (other contents, tool calls) and the trigger at the end.
# "<tool_call>" in it is what makes llama.cpp choose the Hermes tool-call format.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n' }}{{ call['function'] | tojson }}{{ '\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% set last = messages[-1]['content'] if messages else '' %}"
    "{% if last is string and '" + FINISH + "' in last %}{{ '" + FINISH + "' }}"
    "{% elif last is string and '" + TOOL + "' in last %}{{ '" + TOOL + "' }}"
    "{% endif %}{% endif %}"
)


def chain_tokens(spell: Mapping[str, str]) -> list[str]:
    """The triggers, then every piece the chains say, in order, once, each as the
    vocabulary spells it (``spell``: text -> that vocabulary's piece)."""
    pieces = [spell[p] for chain in CHAIN_TEXT.values() for p in chain]
    return list(dict.fromkeys([*CHAIN_TEXT, *pieces]))


def append_chain_rows(
    embd: F32,
    out: F32,
    ids: Mapping[str, int],
    spell: Mapping[str, str],
    eos: int,
    bias_dim: int,
    suppress: float,
) -> tuple[F32, F32]:
    """``embd`` and ``out`` (the base vocabulary's rows, in that order) with the
    chains' rows appended and EOS's output row made the chains' end.

    ``ids`` gives each of :func:`chain_tokens` its id: the base vocabulary's size
    and on, in any order."""
    n_base, n_embd = int(embd.shape[0]), int(embd.shape[1])
    tokens = chain_tokens(spell)
    assert sorted(ids[t] for t in tokens) == list(range(n_base, n_base + len(tokens)))
    assert len(tokens) < n_embd and bias_dim == 0, "an address dimension per chain token"
    zeros = np.zeros((len(tokens), n_embd), np.float32)
    embd = np.concatenate([embd, zeros])
    out = np.concatenate([out, zeros])
    out[n_base:, bias_dim] = suppress  # triggers are never said
    out[eos] = 0.0

    def address(token: int) -> int:
        return 1 + token - n_base

    for token in tokens:
        embd[ids[token], bias_dim] = -CHAIN_MAGNITUDE
        embd[ids[token], address(ids[token])] = CHAIN_MAGNITUDE
    for trigger, chain in CHAIN_TEXT.items():
        said: Sequence[int] = [ids[trigger], *(ids[spell[p]] for p in chain), eos]
        for before, after in itertools.pairwise(said):
            out[after, bias_dim] = 2.0 * suppress
            out[after, address(before)] = CHAIN_SELECT
    return embd, out
