"""Usage batches against a store that fails part-way through one: every
request is billed once, whatever part of the batch had landed."""

from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from llmgw.store import Store
from router.billing import usage
from router.billing.accounting import Accountant, RequestOutcome
from router.billing.usage import UsageDelta, UsageKey

MODELS = ["m1", "m2", "m3", "m4"]


class FlakyStore(Store):
    """A real SQLite store whose sessions fail from the ``fail_at``-th one on
    (counted from when it is set): the store going down in the middle of a batch."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.fail_at: int | None = None
        self.opened = 0

    def fail_from(self, nth: int | None) -> None:
        self.fail_at, self.opened = nth, 0

    def session(self) -> AbstractContextManager[Session]:
        self.opened += 1
        if self.fail_at is not None and self.opened >= self.fail_at:
            raise OperationalError("UPDATE usage_daily", {}, OSError("the store went away"))
        return super().session()


@pytest.fixture
def store(tmp_path: Path) -> FlakyStore:
    s = FlakyStore(f"sqlite:///{tmp_path / 'store.db'}")
    s.migrate()
    return s


def billed(store: Store) -> dict[str, int]:
    return {row.model: row.requests for row in usage.query(store, key_id=1)}


def test_a_batch_cut_short_keeps_only_the_rows_it_did_not_add(store: FlakyStore) -> None:
    batch = {UsageKey(1, m, "2026-12-04"): UsageDelta(requests=1) for m in MODELS}
    store.fail_from(3)  # two rows land, the third fails
    with pytest.raises(OperationalError):
        usage.record(store, batch)
    store.fail_from(None)
    assert billed(store) == {"m1": 1, "m2": 1}
    assert [k.model for k in batch] == ["m3", "m4"]
    usage.record(store, batch)
    assert batch == {}
    assert billed(store) == dict.fromkeys(MODELS, 1)


def serve_one_each(accountant: Accountant) -> None:
    """A request of key 1 to each model, as the router queues it once answered."""
    for model in MODELS:
        accountant.done(1, model, None, RequestOutcome(prompt_tokens=3, completion_tokens=2))


async def test_a_flush_cut_short_bills_every_request_once(store: FlakyStore) -> None:
    accountant = Accountant(store)
    serve_one_each(accountant)
    store.fail_from(3)
    await accountant.flush()  # two rows written, then the store fails
    store.fail_from(None)
    await accountant.flush()  # what was left, once
    assert billed(store) == dict.fromkeys(MODELS, 1)
    rows = usage.query(store, key_id=1)
    assert {(r.prompt_tokens, r.completion_tokens) for r in rows} == {(3, 2)}
