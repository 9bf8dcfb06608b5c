"""Client and admin key checks, with a short cache so the hot path rarely hits the store.

Revocation bound: a key revoked through this router's admin API stops
working here at once (its cache entry is dropped); on other router processes
it stops within ``ttl_s`` (``LLMGW_KEY_CACHE_TTL_S``, default 5 s), the life
of a cached answer. Expiry is checked on every request against the cached
expiry time, so it is exact everywhere.

A store that stalls or fails does not take known keys down: a request waits
for a key's lookup at most ``store_wait_s`` (``LLMGW_STORE_WAIT_S``, 2 s),
then the last answer the store gave for that key serves, for up to
``stale_s`` (``LLMGW_KEY_STALE_S``, an hour) after it was read; a key with no
answer that recent gets 503 ``store_unavailable``. A revocation cannot reach
the store while it is down either, so a stale answer admits no key the
store would refuse.
"""

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from llmgw.api_keys import hash_api_key
from llmgw.engine_keys import exec_key_id
from llmgw.errors import StoreError
from llmgw.store import Store
from llmgw.types import Priority
from router.api.apikeys import KeyInfo, get_key, lookup
from router.billing.key_policy import KeyPolicy
from router.common.blocking import STORE_WAIT_S, Warnings, within
from router.common.errors import ErrorKind

log = logging.getLogger(__name__)

NEGATIVE_CACHE_MAX = 10_000


@dataclass(frozen=True)
class Caller:
    """Who sent a request."""

    key_id: int
    key_name: str
    policy: KeyPolicy
    # The control worker acting as the key (the exec token bound to it): the
    # headers below are honoured only then, and only the inference endpoints
    # (and the executor's own) take it (``exec_allowed``).
    exec: bool = False
    # X-Llmgw-Priority: the admission class instead of the key's own.
    priority_override: Priority | None = None
    # X-Llmgw-Billed-By-Caller: quota as usual, no usage row (the caller bills).
    billed_by_caller: bool = False

    @property
    def priority(self) -> Priority:
        """The admission class this request waits in."""
        return self.priority_override or Priority(self.policy.priority)


# A request header by its lower-case name (None when absent).
HeaderFn = Callable[[str], str | None]

KEY_ID_HEADER = "x-llmgw-key-id"
PRIORITY_HEADER = "x-llmgw-priority"
BILLED_BY_CALLER_HEADER = "x-llmgw-billed-by-caller"

# The routes besides the inference endpoints (router/api/openai.py's plain
# ASGI ones, which always take it) where the exec token acts, as (method,
# route template): a batch's lines sent to the Responses API, and the
# executor's validation of a batch. Everything else (files, batches, models,
# the rest of Responses, admin, metrics) is a 403: a job needs none of it.
EXEC_ROUTES = frozenset(
    {("POST", "/v1/responses"), ("POST", "/internal/batches/{batch_id}/validate")}
)


def exec_allowed(method: str, route: str) -> bool:
    """Whether the exec token may call the route (its template) with ``method``."""
    return (method, route) in EXEC_ROUTES


def _read_key_by_id(store: Store, key_id: int) -> KeyInfo | None:
    info = get_key(store, key_id)
    return None if info is None or info.revoked else info


def _bearer(authorization: str | None) -> str | None:
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip() or None


@dataclass(frozen=True)
class _Answer:
    """What the store last said of a key, and when (monotonic seconds)."""

    info: KeyInfo | None
    read_at: float


class KeyVerifier:
    """Verifies ``Authorization: Bearer`` keys against the store.

    Answers, positive and negative, are cached for ``ttl_s``; keys are random
    256-bit tokens, so a new key cannot be in the negative cache. Past that,
    an answer still serves while the store does not answer (module
    docstring); a key's lookup is then retried once per ``ttl_s``, so only
    the requests that arrive while that lookup is pending wait for the store.
    """

    def __init__(
        self,
        store: Store,
        ttl_s: float = 5.0,
        admin_key: str = "",
        store_wait_s: float = STORE_WAIT_S,
        stale_s: float = 3600.0,
        read_key: Callable[[Store, str], KeyInfo | None] = lookup,
        clock: Callable[[], float] = time.monotonic,
        exec_secret: str = "",
        read_key_by_id: Callable[[Store, int], KeyInfo | None] = _read_key_by_id,
    ) -> None:
        self._store = store
        self._read_key = read_key
        self._read_key_by_id = read_key_by_id
        # The secret exec tokens derive from (the engine-key secret, which a
        # router holds anyway for the engines' keys); "": no exec access.
        self._exec_secret = exec_secret
        self._clock = clock
        self._ttl = ttl_s
        self._wait = store_wait_s
        self._max_stale = stale_s
        self._cache: dict[str, _Answer] = {}
        # When the store last failed a key's lookup; apart from the answers,
        # so that bounding it (random keys during an outage) drops none of them.
        self._failed: dict[str, float] = {}
        self._pending: dict[str, asyncio.Future[KeyInfo | None]] = {}
        self._warnings = Warnings(log, clock)
        # Only the hash of the configured admin key is kept in memory.
        self._admin_digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else b""

    async def _info(self, key: str) -> KeyInfo | None:
        return await self._cached(hash_api_key(key), lambda: self._read_key(self._store, key))

    async def _info_by_id(self, key_id: int) -> KeyInfo | None:
        # Cached apart from presented keys' digests (hex): "id:" cannot collide.
        # Ids are sequential, unlike keys: an id asked for before its key was
        # made would be refused for ttl_s from the negative cache, so an absent
        # id is not remembered (only the exec token's holder asks by id).
        info = await self._cached(f"id:{key_id}", lambda: self._read_key_by_id(self._store, key_id))
        if info is None:
            self._cache.pop(f"id:{key_id}", None)
        return info

    async def _cached(self, digest: str, read: Callable[[], KeyInfo | None]) -> KeyInfo | None:
        now = self._clock()
        hit = self._cache.get(digest)
        if hit is not None and now - hit.read_at < self._ttl:
            return hit.info
        failed = self._failed.get(digest)
        if failed is not None and now - failed < self._ttl:
            return self._last_answer(hit, now)  # the store failed just now: no wait
        # One store lookup per key at a time: when a busy key's entry
        # expires, the requests arriving meanwhile wait for that one lookup
        # rather than each sending its own.
        pending = self._pending.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(read, digest))
            self._pending[digest] = pending
            pending.add_done_callback(lambda _: self._pending.pop(digest, None))
        try:
            return await asyncio.shield(pending)
        except StoreError:
            return self._last_answer(self._cache.get(digest), now)

    def _last_answer(self, answer: _Answer | None, now: float) -> KeyInfo | None:
        """The last answer while the store does not give one, or 503 if there
        is none recent enough."""
        if answer is None or now - answer.read_at > self._max_stale:
            raise ErrorKind.STORE_UNAVAILABLE.error()
        return answer.info

    async def _lookup(self, read: Callable[[], KeyInfo | None], digest: str) -> KeyInfo | None:
        """The store's answer, cached; StoreError past ``store_wait_s`` (noted,
        so the key's requests of the next ``ttl_s`` do not wait)."""
        try:
            info = await within(self._wait, read)
        except StoreError as exc:
            now = self._clock()
            if len(self._failed) >= NEGATIVE_CACHE_MAX:
                self._failed.clear()
            self._failed[digest] = now
            self._warnings.warn("store did not answer a key lookup (%s): cached answers serve", exc)
            raise
        self._failed.pop(digest, None)
        if info is None and len(self._cache) >= NEGATIVE_CACHE_MAX:
            self._cache.clear()  # bounded: a flood of bad keys cannot grow it
        self._cache[digest] = _Answer(info, self._clock())
        return info

    def exec_key(self, authorization: str | None) -> int | None:
        """The key id the header's exec token is bound to (constant-time
        compare), or None when it carries no exec token."""
        key = _bearer(authorization)
        if key is None or not self._exec_secret:
            return None
        return exec_key_id(self._exec_secret, key)

    def is_exec(self, authorization: str | None) -> bool:
        """Whether the header carries an exec token."""
        return self.exec_key(authorization) is not None

    async def verify(self, authorization: str | None, headers: HeaderFn | None = None) -> Caller:
        """The caller behind an Authorization header, or a 401 OpenAIError.

        ``headers`` reads the request's other headers: with the exec token,
        the exec-only headers (and ``X-Llmgw-Key-Id``, which must name the
        token's own key). Without ``headers`` the exec token is refused."""
        bound = self.exec_key(authorization)
        if bound is not None:
            if headers is None:
                raise ErrorKind.EXEC_NOT_ALLOWED.error()
            return await self._exec_caller(bound, headers)
        key = _bearer(authorization)
        if key is None:
            raise ErrorKind.INVALID_KEY.error()
        info = await self._info(key)
        return self._caller(info)

    async def verify_exec(self, authorization: str | None) -> int:
        """The key id of the header's exec token (the internal endpoints act
        as that key only), else 401."""
        bound = self.exec_key(authorization)
        if bound is None:
            raise ErrorKind.INVALID_KEY.error()
        return bound

    async def _exec_caller(self, bound: int, headers: HeaderFn) -> Caller:
        # X-Llmgw-Key-Id may name the key, as before tokens were bound: its
        # own only (a token of one job's key acts for no other).
        raw = headers(KEY_ID_HEADER)
        if raw is not None and raw.strip() != str(bound):
            raise ErrorKind.INVALID_KEY.error()
        info = await self._info_by_id(bound)
        caller = self._caller(info)
        priority = (headers(PRIORITY_HEADER) or "").strip().lower()
        billed = (headers(BILLED_BY_CALLER_HEADER) or "").strip().lower()
        return Caller(
            key_id=caller.key_id,
            key_name=caller.key_name,
            policy=caller.policy,
            exec=True,
            priority_override=Priority.BATCH if priority == Priority.BATCH.value else None,
            billed_by_caller=billed in ("1", "true", "yes"),
        )

    @staticmethod
    def _caller(info: KeyInfo | None) -> Caller:
        if info is None or info.policy.admin:
            raise ErrorKind.INVALID_KEY.error()
        if info.expired(datetime.now(UTC)):
            raise ErrorKind.KEY_EXPIRED.error()
        return Caller(key_id=info.id, key_name=info.name, policy=info.policy)

    async def verify_admin(self, authorization: str | None) -> None:
        """Pass when the header carries the admin key (configured or stored), else 401."""
        key = _bearer(authorization)
        if key is None:
            raise ErrorKind.ADMIN_REQUIRED.error()
        if self.is_exec(authorization):
            raise ErrorKind.EXEC_NOT_ALLOWED.error()
        if self._admin_digest and hmac.compare_digest(
            hashlib.sha256(key.encode()).digest(), self._admin_digest
        ):
            return
        info = await self._info(key)
        if info is None or not info.policy.admin or info.expired(datetime.now(UTC)):
            raise ErrorKind.ADMIN_REQUIRED.error()

    def forget(self, key_id: int) -> None:
        """Drop a key's cached answer (it was just revoked here)."""
        for digest, answer in list(self._cache.items()):  # by key and by id
            if answer.info is not None and answer.info.id == key_id:
                del self._cache[digest]
