"""Cache scopes: whose prompts may share a model's prompt cache (catalog
``cache_scope``; docs/guides/security.md, trust boundary).

A request's scope id names the callers it may share cached prefixes with:
its own key (``key:<id>``, the default), or everyone (``""``: ``shared``).
Three things follow it:

- the prefix index: the scope's salt (below) seeds the request's chunk
  chain (router/affinity/chunks.py), so no digest of one scope ever equals
  one of another's, and a replica holding a prefix for one scope is never
  credited with it for another (routing, slot choice and slot priming
  alike); nor can a tenant compute where another's conversation on a
  guessed prompt was placed (its lead is keyed by the router's secret);
- engines that can salt their cache (vLLM and SGLang: ``cache_salt``) are sent
  a salt derived from the scope id with a router secret (:func:`cache_salt`),
  never the client's own;
- an engine that cannot (llama.cpp) may serve one scope's request from
  another's cache: the caller is told no cached tokens (router/forwarding/
  cache_report.py), and what is left is timing (the security guide).
"""

import hashlib
import hmac

from llmgw.types import CacheScope, EngineKind, ModelSpec

# Scope id of ``cache_scope: shared``: the chain starts as it always did.
SHARED = ""
# The engines with a per-request cache salt (``cache_salt``): vLLM since 0.9
# (its PR 17045, CVE-2025-46570), SGLang since its issue 9163 (made to work in
# its PR 23300). Neither salts an external KV store it may be given (LMCache,
# HiCache's L3): docs/guides/security.md.
SALTED_ENGINES = frozenset({EngineKind.VLLM, EngineKind.SGLANG})
# The request field those engines read, which the router alone may set.
SALT_FIELD = "cache_salt"
_SALT_CONTEXT = b"llmgw-cache-salt\0"


def scope_of(spec: ModelSpec | None, key_id: int) -> str:
    """The scope id of a request by ``key_id`` for ``spec`` (a model outside
    the catalog: the default, the key's own)."""
    scope = spec.cache_scope if spec is not None else CacheScope.KEY
    if scope is CacheScope.SHARED:
        return SHARED
    return f"key:{key_id}"


def cache_salt(secret: str, scope: str) -> str:
    """The engine cache salt of ``scope``: HMAC-SHA256 of it under the router's
    secret, hex. Unguessable without the secret (a client cannot send another
    scope's salt even if the field were let through: it is not), the same in
    every router (they share the secret), and within what vLLM accepts:
    non-empty, at most 128 characters, none of ``@ / \\`` nor NUL (its
    validate_cache_salt, vLLM PRs 51444 and 56681; a salt it refuses would
    fail every request). The client's own ``cache_salt`` never reaches an
    engine (router/api/openai.py refuses it): a caller could otherwise name
    another scope's salt, or one the engine chokes on (issue 34 names
    CVE-2026-105756 for salt validation; the reference corpus has vLLM's
    CVE-2025-46570, the timing channel salts close, and the checks above)."""
    if not secret:
        raise ValueError("empty cache-salt secret")
    mac = hmac.new(secret.encode(), _SALT_CONTEXT + scope.encode(), hashlib.sha256)
    return mac.hexdigest()


def salts(spec: ModelSpec | None, scope: str) -> bool:
    """Whether requests of ``spec`` in ``scope`` carry a router-made salt."""
    return scope != SHARED and spec is not None and spec.engine in SALTED_ENGINES


def hides_cached(spec: ModelSpec | None, scope: str) -> bool:
    """Whether the caller must not see the engine's cached-token count: its
    cache is shared by every scope (llama.cpp, or an engine of unknown kind),
    so the count may include another scope's prefix."""
    if scope == SHARED:
        return False
    return spec is None or spec.engine not in SALTED_ENGINES
