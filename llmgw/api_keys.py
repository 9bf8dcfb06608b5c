"""Client API keys: how they are made and the form in which they are stored.

Client API keys are random 32-byte tokens; only their SHA-256 is stored.
A fast hash is right here: the keys carry 256 bits of entropy, so there is
nothing for a slow password hash to protect against.
"""

import hashlib
import secrets

API_KEY_PREFIX = "sk-llmgw-"


def new_api_key() -> str:
    """A fresh client API key; shown once, never stored in clear."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """The stored form of a client API key."""
    return hashlib.sha256(key.encode()).hexdigest()
