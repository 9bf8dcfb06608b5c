"""Quota reservations and usage, as the request path uses them.

Reserving is synchronous with the request (it must hold before forwarding)
but runs in a thread, waited for at most ``store_wait_s``: a store that
does not answer in time gets the request 503 ``store_unavailable``.
Settling and usage are not on the request path: they are queued in memory
and written in one batch every ``flush_interval_s`` (and at shutdown), so a
request costs the store one UPDATE when its key has quotas and nothing when
it has none. A router killed with SIGKILL loses at most the last interval's
usage; its reservations then stay counted until their window ends (the
safe direction).
"""

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.errors import StoreError
from llmgw.store import Store
from router.apikeys import KeyPolicy
from router.blocking import STORE_WAIT_S, Warnings, in_thread, within
from router.errors import store_unavailable
from router.quotas import Limits, Quotas, Rejection, Reservation
from router.usage import UsageDelta, UsageKey, day_of, record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How a forwarded request ended."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: bool = False
    status: int = 200


class Accountant:
    """Reserves quota, then queues settlements and usage for the next batch write."""

    def __init__(
        self,
        store: Store,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        store_wait_s: float = STORE_WAIT_S,
    ) -> None:
        self._store = store
        self._clock = clock
        self._wait = store_wait_s
        self._warnings = Warnings(log)
        self._quotas = Quotas(store)
        self._interval = flush_interval_s
        self._usage: dict[UsageKey, UsageDelta] = defaultdict(UsageDelta)
        self._settle: dict[tuple[int, str, int], int] = defaultdict(int)
        self._lock = asyncio.Lock()

    async def reserve(
        self, key_id: int, policy: KeyPolicy, tokens: int
    ) -> Reservation | Rejection | None:
        """Reserve ``tokens`` and one request for the key; None when it has no quota."""
        if not policy.has_quota():
            return None
        limits = Limits(policy.rpm, policy.tpm, policy.token_budget, policy.budget_period)
        now = self._clock()
        # Past the bound the request is answered 503 and must not be counted:
        # a call still queued for a thread then (the store froze and every
        # worker thread waits on it) does nothing when it runs. One already
        # running when the store froze lands when it thaws: counted, never
        # settled, until its windows pass (the safe direction).
        deadline = time.monotonic() + self._wait

        def reserve() -> Reservation | Rejection:
            if time.monotonic() > deadline:
                raise StoreError("the request no longer waits for this reservation")
            return self._quotas.reserve(key_id, limits, tokens, now)

        try:
            return await within(self._wait, reserve)
        except StoreError as exc:
            self._warnings.warn("quota reservation for key %d: %s", key_id, exc)
            raise store_unavailable() from exc

    def done(
        self, key_id: int, model: str, reservation: Reservation | None, outcome: Outcome
    ) -> None:
        """Queue a finished request's usage and its reservation's settlement (no I/O)."""
        delta = self._usage[UsageKey(key_id, model, day_of(self._clock()))]
        delta.add(
            UsageDelta(
                requests=1,
                errors=int(outcome.error or outcome.status >= 400),
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
            )
        )
        if reservation is not None:
            diff = outcome.prompt_tokens + outcome.completion_tokens - reservation.tokens
            self._settle[(key_id, "minute", reservation.minute)] += diff
            self._settle[(key_id, "period", reservation.period)] += diff

    async def flush(self) -> None:
        """Write what is queued (one batch, in a thread); a failed part is kept for the next."""
        async with self._lock:
            usage, self._usage = self._usage, defaultdict(UsageDelta)
            settle, self._settle = self._settle, defaultdict(int)
            if settle:
                try:
                    await in_thread(self._quotas.settle, dict(settle))
                except Exception as exc:
                    log.warning("quota settlement failed, will retry: %s", exc)
                    for s, n in settle.items():
                        self._settle[s] += n
            if usage:
                left = dict(usage)  # record() takes out each row it has added
                try:
                    await in_thread(record, self._store, left)
                except Exception as exc:
                    log.warning("usage write failed, will retry: %s", exc)
                finally:  # also when cancelled: shutdown flushes once more
                    for k, d in left.items():
                        self._usage[k].add(d)

    async def run(self) -> None:
        """Flush every interval until cancelled; the caller flushes once more at shutdown."""
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()
