"""Client API key checks, with a short cache so the hot path rarely hits the store."""

import asyncio
import time
from dataclasses import dataclass

from llmgw.keys import hash_api_key
from llmgw.store import Store
from router.errors import invalid_key


@dataclass(frozen=True)
class Caller:
    """Who sent a request."""

    key_id: int
    key_name: str


class KeyVerifier:
    """Verifies ``Authorization: Bearer`` keys against the store.

    Positive answers are cached for ``ttl_s`` (so a revoked key stops working
    within that time); negative answers are not, so a new key works at once.
    """

    def __init__(self, store: Store, ttl_s: float = 5.0) -> None:
        self._store = store
        self._ttl = ttl_s
        self._cache: dict[str, tuple[float, Caller]] = {}

    async def verify(self, authorization: str | None) -> Caller:
        """The caller behind an Authorization header, or a 401 OpenAIError."""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise invalid_key()
        key = authorization[7:].strip()
        digest = hash_api_key(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        row = await asyncio.to_thread(self._store.find_api_key, key)
        if row is None or row.id is None:
            self._cache.pop(digest, None)
            raise invalid_key()
        caller = Caller(key_id=row.id, key_name=row.name)
        self._cache[digest] = (now + self._ttl, caller)
        return caller
