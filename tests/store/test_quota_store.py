"""Quotas, usage and keys at the store level, with several stores (as several
router processes) racing on one database, on SQLite and on PostgreSQL."""

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmgw.store import Store
from router.api.apikeys import create_key, list_keys, lookup, revoke_key
from router.billing.key_policy import KeyPolicy
from router.billing.quotas import (
    Limits,
    QuotaReservation,
    Quotas,
    minute_of,
    period_end,
    period_of,
    sliding_retry_after,
)
from router.billing.usage import UsageDelta, UsageKey, day_of, query, record


@pytest.fixture
def stores(store_url: str) -> Iterator[list[Store]]:
    made = [Store(store_url) for _ in range(4)]
    made[0].migrate()
    yield made
    for s in made:
        s.close()


def test_windows() -> None:
    assert minute_of(119.9) == 1 and period_of(86400 * 3 + 5, "day") == 3
    jan = period_of(1767225600.0, "month")  # 2026-01-01T00:00Z
    assert period_end(jan, "month") == 1769904000.0  # 2026-02-01T00:00Z
    dec = period_of(1797292800.0, "month")  # 2026-12-15T00:00Z
    assert period_end(dec, "month") == 1798761600.0  # 2027-01-01T00:00Z
    # Usage rows' day, cached per day: the last and first instants of days.
    assert [day_of(t) for t in (1798761599.999, 1798761600.0, 0.0, -0.5)] == [
        "2026-12-31", "2027-01-01", "1970-01-01", "1969-12-31",
    ]  # fmt: skip


def test_racing_reservations_admit_exactly_the_limit(stores: list[Store]) -> None:
    info, _ = create_key(stores[0], "k", KeyPolicy(rpm=10, token_budget=100_000))
    now = time.time()

    def reserve(i: int) -> object:
        quotas = Quotas(stores[i % len(stores)])
        return quotas.reserve(info.id, Limits(rpm=10, token_budget=100_000), 50, now)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(reserve, range(200)))
    admitted = [r for r in results if isinstance(r, QuotaReservation)]
    assert len(admitted) == 10
    assert {getattr(r, "limit", None) for r in results if r not in admitted} == {"rpm"}


def test_a_minute_boundary_does_not_double_the_rate(stores: list[Store]) -> None:
    """Sliding minute: ten requests at 00:59 leave nearly no room at 01:01
    (a fixed window would admit ten more), half at 01:30, all at 02:00."""
    info, _ = create_key(stores[0], "k", KeyPolicy(rpm=10))
    quotas, limits = Quotas(stores[1]), Limits(rpm=10)
    m = minute_of(time.time()) * 60.0

    def admitted(at: float) -> int:
        results = [quotas.reserve(info.id, limits, 0, at) for _ in range(12)]
        return sum(isinstance(r, QuotaReservation) for r in results)

    assert admitted(m + 59) == 10
    refused = quotas.reserve(info.id, limits, 0, m + 61)
    assert not isinstance(refused, QuotaReservation) and refused.limit == "rpm"
    # 10 * (1 - t/60) + 0 + 1 <= 10 from t = 6 s into the minute: 5 s from 01:01.
    assert refused.retry_after_s == 5
    assert admitted(m + 61) == 0
    # At 01:30 the previous minute weighs 5: five more fit.
    assert admitted(m + 90) == 5
    # At 02:59 the previous minute (01:xx) held five, weighing 1/60 of them now.
    assert admitted(m + 179) == 9


def test_a_late_update_from_before_the_boundary_does_not_reset_the_window(
    stores: list[Store],
) -> None:
    """A request stamped 00:59.99 whose UPDATE lands after one stamped 01:00.01
    counts in 01:xx; it must not take the row back to 00:xx and lose both."""
    info, _ = create_key(stores[0], "k", KeyPolicy(rpm=10))
    quotas, limits = Quotas(stores[1]), Limits(rpm=10)
    m = minute_of(time.time()) * 60.0
    for i in range(9):
        assert isinstance(quotas.reserve(info.id, limits, 0, m + 10 + i), QuotaReservation)
    assert isinstance(quotas.reserve(info.id, limits, 0, m + 60.01), QuotaReservation)
    assert isinstance(quotas.reserve(info.id, limits, 0, m + 59.99), QuotaReservation)
    # At 01:01: 9 * 59/60 + 2 + 1 > 10. Reset to 00:xx, nine more would pass.
    assert not isinstance(quotas.reserve(info.id, limits, 0, m + 61), QuotaReservation)


def test_a_correction_reaches_a_minute_that_became_the_previous_one(stores: list[Store]) -> None:
    info, _ = create_key(stores[0], "k", KeyPolicy(tpm=1000))
    quotas, limits = Quotas(stores[1]), Limits(tpm=1000)
    m = minute_of(time.time()) * 60.0
    first = quotas.reserve(info.id, limits, 600, m + 50)
    assert isinstance(first, QuotaReservation)
    # At 01:30, 600 * 0.5 = 300 of the last 60 s: 800 does not fit...
    assert not isinstance(quotas.reserve(info.id, limits, 800, m + 90), QuotaReservation)
    # ...until the first request settles at 100 tokens (the row has moved on).
    quotas.settle({(info.id, "minute", first.minute): -500})
    assert isinstance(quotas.reserve(info.id, limits, 800, m + 90), QuotaReservation)


def test_sliding_retry_after() -> None:
    m = 6000.0  # a minute boundary
    assert sliding_retry_after(0, 3, 1, 10, m + 10) == 1  # fits now
    assert sliding_retry_after(10, 0, 1, 10, m + 1) == 5  # 10 * (1 - f) <= 9 at f = 0.1
    # This minute full: next minute, its count decays to room for one.
    assert sliding_retry_after(0, 10, 1, 10, m + 30) == 36
    # Asking more than the limit: after the next minute, and then refused again.
    assert sliding_retry_after(0, 0, 20, 10, m + 30) == 90


def test_budget_and_settlement(stores: list[Store]) -> None:
    info, _ = create_key(stores[0], "k", KeyPolicy(token_budget=1000))
    quotas, limits, now = Quotas(stores[1]), Limits(token_budget=1000), time.time()
    first = quotas.reserve(info.id, limits, 600, now)
    assert isinstance(first, QuotaReservation)
    refused = quotas.reserve(info.id, limits, 600, now)
    assert not isinstance(refused, QuotaReservation) and refused.limit == "token_budget"
    assert refused.retry_after_s <= 86400
    # The first used 100 of its 600: settled, the second fits.
    quotas.settle(
        {(info.id, "minute", first.minute): -500, (info.id, "period", first.period): -500}
    )
    assert isinstance(quotas.reserve(info.id, limits, 600, now), QuotaReservation)
    # Next day: a fresh budget.
    assert isinstance(quotas.reserve(info.id, limits, 1000, now + 86400), QuotaReservation)


def test_usage_adds_up_across_stores(stores: list[Store]) -> None:
    key = UsageKey(7, "m", "2026-12-02")

    def add(i: int) -> None:
        delta = UsageDelta(requests=1, errors=i % 2, prompt_tokens=2, completion_tokens=3)
        record(stores[i % len(stores)], {key: delta})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(add, range(100)))
    [row] = query(stores[0], key_id=7)
    assert (row.requests, row.errors, row.prompt_tokens, row.completion_tokens) == (
        100,
        50,
        200,
        300,
    )
    assert query(stores[0], key_id=7, since="2026-12-03") == []


def test_keys(stores: list[Store]) -> None:
    info, key = create_key(stores[0], "k", KeyPolicy(models=["a"], admin=True))
    found = lookup(stores[1], key)
    assert found is not None and found.policy.models == ["a"] and found.policy.admin
    assert lookup(stores[1], key + "x") is None
    revoke_key(stores[2], info.id)
    assert lookup(stores[1], key) is None
    assert [(k.id, k.revoked) for k in list_keys(stores[3])] == [(info.id, True)]
