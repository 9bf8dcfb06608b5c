"""The request path's store calls while the store does not answer.

KeyVerifier (router/api/auth.py): the last answer serves for ``stale_s``, the
store is asked at most once per TTL and only that request waits, a key with
no recent answer gets 503 ``store_unavailable``; a real SQLite store, the key
read going through a switch (injected through the constructor) that fails or
stalls like a store that is down or frozen, and a clock the test moves.

Accountant (router/billing/accounting.py): a reservation given up on before its
thread started never counts. The end-to-end case, with a real PostgreSQL
frozen and stopped under a router process, is tests/e2e/test_store_outage.py.
"""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from llmgw.store import Store
from router.api.apikeys import KeyInfo, create_key, lookup, revoke_key
from router.api.auth import NEGATIVE_CACHE_MAX, KeyVerifier
from router.billing.accounting import Accountant
from router.billing.key_policy import KeyPolicy
from router.billing.quotas import QuotaRejection, QuotaReservation
from router.common.errors import OpenAIError

TTL_S = 5.0
STALE_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Switch:
    """The store's key read: as it is, failing (down) or blocking (frozen)."""

    def __init__(self) -> None:
        self.mode = "up"
        self.calls = 0
        self.answered = 0
        self.thaw = threading.Event()

    def __call__(self, store: Store, key: str) -> KeyInfo | None:
        self.calls += 1
        if self.mode == "down":
            raise OperationalError("SELECT", {}, ConnectionRefusedError("connection refused"))
        if self.mode == "frozen":
            self.thaw.wait(30)
        info = lookup(store, key)
        self.answered += 1
        return info


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'store.db'}")
    s.migrate()
    return s


@dataclass
class Known:
    """A verifier whose store has answered for ``key`` once."""

    switch: Switch
    clock: Clock
    keys: KeyVerifier
    info: KeyInfo
    key: str

    async def caller_id(self, key: str | None = None) -> int:
        return (await self.keys.verify(f"Bearer {key or self.key}")).key_id


async def known(store: Store) -> Known:
    switch, clock = Switch(), Clock()
    keys = KeyVerifier(
        store, TTL_S, store_wait_s=0.2, stale_s=STALE_S, read_key=switch, clock=clock
    )
    info, key = create_key(store, "k", KeyPolicy())
    assert (await keys.verify(f"Bearer {key}")).key_id == info.id
    assert switch.calls == 1
    return Known(switch, clock, keys, info, key)


async def test_the_last_answer_serves_while_the_store_is_down_asked_once_per_ttl(
    store: Store,
) -> None:
    k = await known(store)
    k.switch.mode = "down"
    k.clock.now += TTL_S + 1  # stale: the store is asked, fails, the answer serves
    assert await k.caller_id() == k.info.id
    assert k.switch.calls == 2
    k.clock.now += 1  # within a TTL of the failure: not asked again
    assert await k.caller_id() == k.info.id
    assert k.switch.calls == 2
    k.clock.now += TTL_S  # asked again (and still failing)
    assert await k.caller_id() == k.info.id
    assert k.switch.calls == 3
    k.switch.mode = "up"
    k.clock.now += TTL_S
    assert await k.caller_id() == k.info.id
    assert k.switch.calls == 4


async def test_an_answer_older_than_the_stale_bound_or_none_at_all_gets_503(
    store: Store,
) -> None:
    k = await known(store)
    _, never_seen = create_key(store, "n", KeyPolicy())
    k.switch.mode = "down"
    for presented in (never_seen, "not-a-key"):
        with pytest.raises(OpenAIError) as caught:
            await k.caller_id(presented)
        assert (caught.value.status, caught.value.code) == (503, "store_unavailable")
    k.clock.now += STALE_S + 1
    with pytest.raises(OpenAIError) as caught:
        await k.caller_id()
    assert caught.value.code == "store_unavailable"


async def test_a_frozen_store_is_waited_for_within_the_bound_then_the_answer_serves(
    store: Store,
) -> None:
    k = await known(store)
    k.switch.mode = "frozen"
    k.clock.now += TTL_S + 1
    try:
        # The read blocks (up to 30 s); the request is answered after 0.2 s,
        # from the cached answer: the store has not answered the second read.
        assert await k.caller_id() == k.info.id
        assert (k.switch.calls, k.switch.answered) == (2, 1)
    finally:
        k.switch.thaw.set()


async def test_a_revoked_key_is_refused_once_the_store_answers_again(store: Store) -> None:
    k = await known(store)
    k.switch.mode = "down"
    k.clock.now += TTL_S + 1
    await k.caller_id()  # served stale: the revocation is not known yet
    revoke_key(store, k.info.id)
    k.switch.mode = "up"
    k.clock.now += TTL_S
    with pytest.raises(OpenAIError) as caught:
        await k.caller_id()
    assert caught.value.status == 401


def test_a_reservation_given_up_on_before_its_thread_started_never_counts(
    store: Store,
) -> None:
    """Every worker thread busy (as when each waits on a frozen store): the
    reservation waits in the queue past the bound, the request gets 503, and
    when a thread takes the call at last it does nothing. (A loop of its own:
    its one-thread executor must not outlive the test.)"""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait, 30)
        accountant = Accountant(store, store_wait_s=0.2)
        info, _ = create_key(store, "q", KeyPolicy(rpm=1))
        try:
            with pytest.raises(OpenAIError) as caught:
                await accountant.reserve(info.id, info.policy, 10)
            assert (caught.value.status, caught.value.code) == (503, "store_unavailable")
        finally:
            gate.set()
        await busy
        await loop.run_in_executor(None, lambda: None)  # the given-up call had its turn
        # The key's one request a minute is still there: nothing was reserved.
        assert isinstance(await accountant.reserve(info.id, info.policy, 10), QuotaReservation)
        assert isinstance(await accountant.reserve(info.id, info.policy, 10), QuotaRejection)

    asyncio.run(scenario())


async def test_random_keys_during_an_outage_drop_no_known_answer(store: Store) -> None:
    """What the router notes of failed lookups is bounded on its own: a flood
    of unknown keys while the store is down leaves the known keys served."""
    k = await known(store)
    k.switch.mode = "down"
    k.clock.now += TTL_S + 1
    for n in range(NEGATIVE_CACHE_MAX + 10):
        with pytest.raises(OpenAIError):
            await k.caller_id(f"random-{n}")
    assert await k.caller_id() == k.info.id
