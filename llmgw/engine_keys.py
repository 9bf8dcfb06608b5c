"""Engine keys: what a replica's engine (its pass-through) requires.

An engine key is HMAC-SHA256(secret, replica_id) rather than a stored
per-replica value: any router process (or one started after the engine, or
after an agent adopted it) can recompute the key of any replica from the one
shared secret, with no table to keep in step. A key taken from one node opens
that one replica only.
"""

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable

# A replica id to its engine key, from a secret the process already holds
# (router, agent).
EngineKeyFn = Callable[[str], str]
# The same, where the secret is read from the store when first needed (the
# control worker's probes).
EngineKeySource = Callable[[str], Awaitable[str]]


def new_secret() -> str:
    """A fresh engine-key secret (hex, 256 bits)."""
    return secrets.token_hex(32)


def engine_key(secret: str, replica_id: str) -> str:
    """The key the engine of ``replica_id`` requires."""
    if not secret:
        raise ValueError("empty engine-key secret")
    mac = hmac.new(secret.encode(), replica_id.encode(), hashlib.sha256)
    return "llmgw-engine-" + mac.hexdigest()


EXEC_TOKEN_PREFIX = "llmgw-exec-"


def exec_token(secret: str) -> str:
    """The credential the control worker's job activities present to a router
    (batch lines, background responses), derived like engine keys from the
    store's secret: every router checks it without a table, and no client key
    (stored hashed) is ever needed to act for the key that owns the job."""
    if not secret:
        raise ValueError("empty engine-key secret")
    mac = hmac.new(secret.encode(), b"llmgw-exec", hashlib.sha256)
    return EXEC_TOKEN_PREFIX + mac.hexdigest()
