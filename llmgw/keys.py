"""Engine keys and client API keys.

An engine key is HMAC-SHA256(secret, replica_id) rather than a stored
per-replica value: any router process (or one started after the engine, or
after an agent adopted it) can recompute the key of any replica from the one
shared secret, with no table to keep in step. A key taken from one node opens
that one replica only.

Client API keys are random 32-byte tokens; only their SHA-256 is stored.
A fast hash is right here: the keys carry 256 bits of entropy, so there is
nothing for a slow password hash to protect against.
"""

import hashlib
import hmac
import secrets

API_KEY_PREFIX = "sk-llmgw-"


def new_secret() -> str:
    """A fresh engine-key secret (hex, 256 bits)."""
    return secrets.token_hex(32)


def engine_key(secret: str, replica_id: str) -> str:
    """The key the engine of ``replica_id`` requires."""
    if not secret:
        raise ValueError("empty engine-key secret")
    mac = hmac.new(secret.encode(), replica_id.encode(), hashlib.sha256)
    return "llmgw-engine-" + mac.hexdigest()


def new_api_key() -> str:
    """A fresh client API key; shown once, never stored in clear."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """The stored form of a client API key."""
    return hashlib.sha256(key.encode()).hexdigest()
