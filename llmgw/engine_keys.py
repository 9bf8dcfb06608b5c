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
# The longest key id a token carries (the store's ids are far shorter).
_MAX_KEY_ID_DIGITS = 18


def exec_token(secret: str, key_id: int) -> str:
    """The credential the control worker's job activities present to a router
    (batch lines, background responses) to act as the job's key ``key_id``,
    and as that key only: ``llmgw-exec-<key_id>-<HMAC(secret, key_id)>``,
    derived like engine keys from the store's secret, so every router checks
    it without a table, and no client key (stored hashed) is ever needed. A
    token taken from one job's calls acts as that job's key, on the
    inference endpoints only (router/api/auth.py), billed to it."""
    if not secret:
        raise ValueError("empty engine-key secret")
    if key_id < 0 or len(str(key_id)) > _MAX_KEY_ID_DIGITS:
        raise ValueError(f"not a key id: {key_id}")
    return f"{EXEC_TOKEN_PREFIX}{key_id}-{_exec_mac(secret, key_id)}"


def _exec_mac(secret: str, key_id: int) -> str:
    return hmac.new(secret.encode(), b"llmgw-exec:%d" % key_id, hashlib.sha256).hexdigest()


def exec_key_id(secret: str, token: str) -> int | None:
    """The key id ``token`` is the exec token of (constant-time compare), or
    None when it is no exec token of ``secret``'s."""
    if not secret or not token.startswith(EXEC_TOKEN_PREFIX):
        return None
    raw, _, mac = token[len(EXEC_TOKEN_PREFIX) :].partition("-")
    if not raw.isdigit() or len(raw) > _MAX_KEY_ID_DIGITS or raw != str(int(raw)):
        return None
    key_id = int(raw)
    if not hmac.compare_digest(mac.encode(), _exec_mac(secret, key_id).encode()):
        return None
    return key_id
