"""Quota reservations and usage, as the request path uses them.

Reserving is synchronous with the request (it must hold before forwarding)
but runs in a thread, waited for at most ``store_wait_s``: a store that
does not answer in time gets the request 503 ``store_unavailable``.
Settling and usage are not on the request path: they are queued in memory
and written in one batch every ``flush_interval_s`` (and at shutdown), so a
request costs the store one UPDATE when its key has quotas and nothing when
it has none. A router killed with SIGKILL loses no usage of the requests it
answered, also during a store outage: usage owed is kept in the spool
(router/billing/usage_batches.py, router/billing/usage_spool.py) for the next router;
its last interval's settlements are lost, so those reservations stay counted
until their window ends (the safe direction).
"""

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass

from llmgw.errors import StoreError
from llmgw.store import Store
from router.billing.key_policy import KeyPolicy
from router.billing.quotas import Limits, QuotaRejection, QuotaReservation, Quotas
from router.billing.usage import UsageDelta, UsageKey, day_of
from router.billing.usage_batches import WRITE_WAIT_S, UsageBatches
from router.billing.usage_spool import UsageSpool
from router.common.blocking import STORE_WAIT_S, Warnings, within
from router.common.errors import ErrorKind

log = logging.getLogger(__name__)

# A reservation made before its request (a background response's, when it
# was created: router/api/response_quota.py). The in-process chat request that
# runs it is started with this set (a task copies its context), and its
# ``reserve`` takes it instead of reserving again. Never from a client: only
# code in the router sets it.
HELD_RESERVATION: ContextVar[QuotaReservation | None] = ContextVar(
    "llmgw_held_reservation", default=None
)


@dataclass(frozen=True)
class RequestOutcome:
    """How a forwarded request ended."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: bool = False
    status: int = 200
    # Of the prompt, the tokens the engine took from its cache
    # (usage.prompt_tokens_details.cached_tokens); None: it did not say.
    cached_tokens: int | None = None


class Accountant:
    """Reserves quota, then queues settlements and usage for the next batch write."""

    def __init__(
        self,
        store: Store,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        store_wait_s: float = STORE_WAIT_S,
        spool: UsageSpool | None = None,
        write_wait_s: float = WRITE_WAIT_S,
    ) -> None:
        self._clock = clock
        self._wait = store_wait_s
        self._warnings = Warnings(log)
        self._quotas = Quotas(store)
        self._interval = flush_interval_s
        self._usage = UsageBatches(store, spool, write_wait_s)
        self._write_wait = write_wait_s
        self._settle: dict[tuple[int, str, int], int] = defaultdict(int)
        self._settling: asyncio.Future[None] | None = None
        self._lock = asyncio.Lock()

    async def reserve(
        self, key_id: int, policy: KeyPolicy, tokens: int
    ) -> QuotaReservation | QuotaRejection | None:
        """Reserve ``tokens`` and one request for the key; None when it has no
        quota; the held reservation where the request has one (HELD_RESERVATION)."""
        held = HELD_RESERVATION.get()
        if held is not None and held.key_id == key_id:
            HELD_RESERVATION.set(None)  # one request's, once
            return held
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

        def reserve() -> QuotaReservation | QuotaRejection:
            if time.monotonic() > deadline:
                raise StoreError("the request no longer waits for this reservation")
            return self._quotas.reserve(key_id, limits, tokens, now)

        try:
            return await within(self._wait, reserve)
        except StoreError as exc:
            self._warnings.warn("quota reservation for key %d: %s", key_id, exc)
            raise ErrorKind.STORE_UNAVAILABLE.error() from exc

    def done(
        self,
        key_id: int,
        model: str,
        reservation: QuotaReservation | None,
        outcome: RequestOutcome,
        usage: bool = True,
    ) -> None:
        """Queue a finished request's usage and its reservation's settlement (no
        I/O); ``usage`` False: the settlement only (the caller bills the usage:
        a batch line, with its result, exactly once)."""
        if usage:
            self._add_usage(key_id, model, outcome)
        if reservation is not None:
            diff = outcome.prompt_tokens + outcome.completion_tokens - reservation.tokens
            self._settle[(key_id, "minute", reservation.minute)] += diff
            self._settle[(key_id, "period", reservation.period)] += diff

    def _add_usage(self, key_id: int, model: str, outcome: RequestOutcome) -> None:
        self._usage.add(
            UsageKey(key_id, model, day_of(self._clock())),
            UsageDelta(
                requests=1,
                errors=int(outcome.error or outcome.status >= 400),
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
            ),
        )

    async def flush(self) -> None:
        """Write what is queued: settlements and usage, each one batch at a
        time in a thread, waited for within a bound (a frozen store holds the
        thread, not the flush); usage owed meanwhile is kept in the spool."""
        async with self._lock:
            if self._settling is None and self._settle:
                self._start_settling()
            waits: list[Awaitable[object]] = [self._usage.flush()]
            if self._settling is not None:
                waits.append(asyncio.wait([self._settling], timeout=self._write_wait))
            await asyncio.gather(*waits)

    def _start_settling(self) -> None:
        settle, self._settle = dict(self._settle), defaultdict(int)
        settling = asyncio.ensure_future(asyncio.to_thread(self._quotas.settle, settle))

        def settled(done: "asyncio.Future[None]") -> None:
            self._settling = None
            if not done.cancelled() and (exc := done.exception()) is not None:
                log.warning("quota settlement failed, will retry: %s", exc)
                for s, n in settle.items():  # one transaction: none of it landed
                    self._settle[s] += n

        settling.add_done_callback(settled)
        self._settling = settling

    async def open(self) -> None:
        """Queue the usage that routers stopped during a store outage left
        in the spool (from its lock on, this router's spool is its own)."""
        await self._usage.open()

    async def close(self) -> None:
        """After the last flush: what is owed stays in the spool."""
        await self._usage.close()

    async def run(self) -> None:
        """Flush every interval until cancelled; the caller flushes once more at shutdown."""
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()
