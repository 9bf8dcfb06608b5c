"""Client and admin key checks, with a short cache so the hot path rarely hits the store.

Revocation bound: a key revoked through this router's admin API stops
working here at once (its cache entry is dropped); on other router processes
it stops within ``ttl_s`` (``LLMGW_KEY_CACHE_TTL_S``, default 5 s), the life
of a cached answer. Expiry is checked on every request against the cached
expiry time, so it is exact everywhere.
"""

import asyncio
import hashlib
import hmac
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from llmgw.keys import hash_api_key
from llmgw.store import Store
from router.apikeys import KeyInfo, KeyPolicy, lookup
from router.errors import admin_required, invalid_key, key_expired

NEGATIVE_CACHE_MAX = 10_000


@dataclass(frozen=True)
class Caller:
    """Who sent a request."""

    key_id: int
    key_name: str
    policy: KeyPolicy


def _bearer(authorization: str | None) -> str | None:
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip() or None


class KeyVerifier:
    """Verifies ``Authorization: Bearer`` keys against the store.

    Answers, positive and negative, are cached for ``ttl_s``; keys are random
    256-bit tokens, so a new key cannot be in the negative cache.
    """

    def __init__(self, store: Store, ttl_s: float = 5.0, admin_key: str = "") -> None:
        self._store = store
        self._ttl = ttl_s
        self._cache: dict[str, tuple[float, KeyInfo | None]] = {}
        self._pending: dict[str, asyncio.Future[KeyInfo | None]] = {}
        # Only the hash of the configured admin key is kept in memory.
        self._admin_digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else b""

    async def _info(self, key: str) -> KeyInfo | None:
        digest = hash_api_key(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        # One store lookup per key at a time: when a busy key's entry
        # expires, the requests arriving meanwhile wait for that one lookup
        # rather than each sending its own.
        pending = self._pending.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(lookup, self._store, key))
            self._pending[digest] = pending
            pending.add_done_callback(lambda _: self._pending.pop(digest, None))
        info = await asyncio.shield(pending)
        if info is None and len(self._cache) >= NEGATIVE_CACHE_MAX:
            self._cache.clear()  # bounded: a flood of bad keys cannot grow it
        self._cache[digest] = (now + self._ttl, info)
        return info

    async def verify(self, authorization: str | None) -> Caller:
        """The caller behind an Authorization header, or a 401 OpenAIError."""
        key = _bearer(authorization)
        if key is None:
            raise invalid_key()
        info = await self._info(key)
        if info is None or info.policy.admin:
            raise invalid_key()
        if info.expired(datetime.now(UTC)):
            raise key_expired()
        return Caller(key_id=info.id, key_name=info.name, policy=info.policy)

    async def verify_admin(self, authorization: str | None) -> None:
        """Pass when the header carries the admin key (configured or stored), else 401."""
        key = _bearer(authorization)
        if key is None:
            raise admin_required()
        if self._admin_digest and hmac.compare_digest(
            hashlib.sha256(key.encode()).digest(), self._admin_digest
        ):
            return
        info = await self._info(key)
        if info is None or not info.policy.admin or info.expired(datetime.now(UTC)):
            raise admin_required()

    def forget(self, key_id: int) -> None:
        """Drop a key's cached answer (it was just revoked here)."""
        for digest, (_, info) in list(self._cache.items()):
            if info is not None and info.id == key_id:
                del self._cache[digest]
