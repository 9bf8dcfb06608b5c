"""What a caller is told of the engine's prompt cache, where that cache is
shared with other cache scopes (llama.cpp: router/affinity/scope.py).

llama.cpp reuses whatever its slots hold, whoever sent it: a count of cached
tokens (``usage.prompt_tokens_details.cached_tokens``), its ``timings``
(``cache_n``, ``prompt_n``, ``prompt_ms``), its ``__verbose`` result or its
``prompt_progress`` would tell a caller how much of its prompt another
tenant sent before, which is the probe of issue 34 (840 of 841 tokens for
a right guess, 0 for a wrong one). The router's index knows only its own
estimate of what this scope left on the replica, in its own token units,
and any figure the engine's count passes through could still differ
between a right and a wrong guess. So the caller gets 0 cached tokens and
none of the engine's own figures; the engine's count still reaches
billing, the router's metrics and its index (admins see them), as before.

What is left is timing: a prefix found cached answers sooner (the security
guide's trust boundary).
"""

import json
from typing import Any

import orjson

# What llama.cpp adds of its own that says the same: its per-request
# timings (cache_n, prompt_n, prompt_ms ...); with ``verbose`` its whole
# native result (tokens_cached, timings); with ``return_progress`` a stream's
# prompt progress (cache, processed). Checked against this project's build.
ENGINE_FIGURES = ("timings", "__verbose", "prompt_progress")
_MENTIONS = (b'"cached_tokens"', *(b'"%s"' % name.encode() for name in ENGINE_FIGURES))


def hide_in(obj: dict[str, Any]) -> bool:
    """Hide the cache's figures in one answer or stream event, in place:
    cached tokens 0 where reported, none of ``ENGINE_FIGURES``. Whether
    anything changed."""
    changed = False
    for name in ENGINE_FIGURES:
        changed = obj.pop(name, None) is not None or changed
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens"):
            details["cached_tokens"] = 0
            changed = True
    return changed


def hidden(content: bytes) -> bytes:
    """A whole JSON answer with the cache's figures hidden (``hide_in``);
    anything else (not JSON, not an object) as it came."""
    try:
        obj = orjson.loads(content)
    except orjson.JSONDecodeError:
        # What orjson refuses and the standard library reads (NaN, integers
        # past 64 bits): hidden all the same.
        try:
            obj = json.loads(content)
        except ValueError:
            return content
        if not isinstance(obj, dict) or not hide_in(obj):
            return content
        return json.dumps(obj, separators=(",", ":")).encode()
    if not isinstance(obj, dict) or not hide_in(obj):
        return content
    return orjson.dumps(obj)


def mentions(events: bytes) -> bool:
    """Whether some event in ``events`` may carry the cache's figures."""
    return any(name in events for name in _MENTIONS)
