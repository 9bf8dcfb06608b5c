"""What an inference request reserves of its key's tokens before it is sent:
an estimate of its prompt (no tokenizer on the router's path) plus every
token the engine may generate. Read by the inference endpoints
(router/api/openai.py) and by a background response's creation
(router/api/response_quota.py), so the two reserve alike."""

import math

from router.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    _Generation,
)
from router.billing.key_policy import KeyPolicy
from router.common.errors import ErrorKind

Body = ChatCompletionRequest | CompletionRequest | EmbeddingRequest

# Added to the prompt estimate: a chat template wraps every message (and the
# whole conversation) in tokens of its own.
CHAT_MESSAGE_TOKENS = 16
CHAT_BASE_TOKENS = 64
# When the client sets no max_tokens and the model is not in the catalog.
DEFAULT_COMPLETION_RESERVE = 4096


def estimate(body: Body) -> int:
    """The prompt's tokens, estimated from its bytes (two a token), with the
    chat template's own."""
    prompt = math.ceil(body.prompt_bytes() / 2)
    if isinstance(body, ChatCompletionRequest):
        return prompt + CHAT_BASE_TOKENS + CHAT_MESSAGE_TOKENS * len(body.messages)
    if isinstance(body, EmbeddingRequest):
        return prompt + 4 * body.inputs()
    return prompt + 4


# A reservation is stored in 64-bit counters; past any int32 limit it fits no quota anyway.
MAX_RESERVATION = 2**31 - 1


def reserved_tokens(body: Body, context_length: int) -> int:
    """What a request reserves of its key's tokens: the prompt estimate plus
    every token the engine may generate, ``choices`` times for each prompt
    (``n``, llama.cpp's ``n_cmpl``, ``best_of``), each at most the context."""
    total = estimate(body)
    if isinstance(body, _Generation):
        limit = body.completion_limit() or context_length
        total += min(limit, context_length) * body.choices() * body.prompts()
    return min(total, MAX_RESERVATION)


def bounded(body: Body, policy: KeyPolicy) -> None:
    """Refuse generation the client leaves unbounded when the key's tokens are counted."""
    if isinstance(body, _Generation) and body.unbounded() and (policy.tpm or policy.token_budget):
        raise ErrorKind.UNBOUNDED_GENERATION.error()
