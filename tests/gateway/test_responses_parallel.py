"""``/v1/responses`` under parallel use (issue 34): a key's bound on its
stored responses holds when its creations come at once (the check and the
insert one step under the key's lock), and a background response cancelled
before its run began gives back the quota it took at creation, exactly once
whichever of the cancel and the run comes first. Through the real router
app (a mock engine), on SQLite and PostgreSQL."""

import asyncio

from sqlmodel import func, select

from llmgw.store import Store
from llmgw.store.gateway_tables import QuotaWindow
from llmgw.store.openai_tables import ResponseRecord
from router.responses import store as rstore
from router.responses.bounds import ResponseBounds
from tests.gateway.test_responses_bounds import create, error_of, rows, run_headers, serve
from tests.gateway_util import Gateway, auth

CREATIONS = 12
ROUNDS = 3
# Each response stores about 6,800 bytes (its input in the response, the chat
# body and the items): room for two of them.
BOUND = 15_000
# A response of 300 output tokens reserves a bit over 300 tokens: one fits
# the minute's 500, two do not.
TPM = 500
TOKENS = 300


def held_bytes(store: Store, key_id: int) -> int:
    with store.session() as session:
        return int(
            session.exec(
                select(func.coalesce(func.sum(ResponseRecord.stored_bytes), 0)).where(
                    ResponseRecord.key_id == key_id,
                    ResponseRecord.deleted_at == None,  # noqa: E711
                )
            ).one()
        )


async def test_parallel_creations_stay_within_the_keys_bound(store_url: str) -> None:
    """Twelve creations of one key at once (three rounds), room for two: each checked in one
    transaction and inserted in another, all of them passed on what the
    others had not stored yet; now what the key holds never passes the
    bound, and the refused get a 400 ``response_storage_full``."""
    bounds = ResponseBounds(max_response_bytes=10**6, max_key_response_bytes=BOUND)
    async with serve(store_url, response_bounds=bounds) as gw:
        for _ in range(ROUNDS):  # a new key each round
            key_id, key = gw.key()
            answers = await asyncio.gather(
                *(create(gw, key, input="z" * 3000, background=True) for _ in range(CREATIONS))
            )
            taken = [a for a in answers if a.status_code == 200]
            held = held_bytes(gw.store, key_id)
            assert held <= BOUND, (len(taken), held)
            assert rows(gw.store, key_id) == len(taken) == 2, held
            for answer in answers:
                if answer.status_code != 200:
                    assert answer.status_code == 400, answer.text
                    assert error_of(answer)["code"] == "response_storage_full", answer.text


def minute_tokens(store: Store, key_id: int) -> int:
    """The tokens the key's quota counts this minute and the one before."""
    with store.session() as session:
        row = session.get(QuotaWindow, key_id)
        return 0 if row is None else row.minute_tokens + row.prev_minute_tokens


async def flushed(gw: Gateway) -> None:
    """The router's queued settlements written."""
    await gw.app.state.deps.accountant.flush()


async def test_a_cancel_before_the_run_gives_the_quota_back(store_url: str) -> None:
    """A key of 500 tokens a minute creates a background response of 300
    and cancels it before it runs: its tokens are the key's again (before,
    they stayed counted until the minute passed), and a run arriving after
    the cancel generates nothing and gives nothing back a second time."""
    async with serve(store_url) as gw:
        key_id, key = gw.key(tpm=TPM)
        first = await create(gw, key, background=True, max_output_tokens=TOKENS)
        assert first.status_code == 200, first.text
        reserved = minute_tokens(gw.store, key_id)
        assert TOKENS <= reserved <= TPM
        second = await create(gw, key, background=True, max_output_tokens=TOKENS)
        assert second.status_code == 429, second.text
        response_id = first.json()["id"]
        cancel = await gw.http.post(f"/v1/responses/{response_id}/cancel", headers=auth(key))
        assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled", cancel.text
        await flushed(gw)
        assert minute_tokens(gw.store, key_id) == 0
        # The run the workflow started before the cancel reached it.
        run = await gw.http.post(
            f"/internal/responses/{response_id}/run", headers=run_headers(gw, key_id)
        )
        assert run.status_code == 200 and run.json()["status"] == "cancelled", run.text
        assert not gw.engine.seen
        await flushed(gw)
        assert minute_tokens(gw.store, key_id) == 0
        # The tokens are the key's to use.
        again = await create(gw, key, background=True, max_output_tokens=TOKENS)
        assert again.status_code == 200, again.text
        assert minute_tokens(gw.store, key_id) == reserved


async def test_a_cancel_after_the_run_began_leaves_the_quota_to_the_run(store_url: str) -> None:
    """Once a run's first attempt has begun (it took the reservation), a
    cancel gives nothing back: the run's request settles it, once."""
    async with serve(store_url) as gw:
        key_id, key = gw.key(tpm=TPM)
        first = await create(gw, key, background=True, max_output_tokens=TOKENS)
        assert first.status_code == 200, first.text
        reserved = minute_tokens(gw.store, key_id)
        response_id = first.json()["id"]
        assert rstore.begin_attempt(gw.store, response_id) == (1, "queued")
        stopped = rstore.cancel_response(gw.store, key_id, response_id, 0)
        assert stopped is not None and stopped.record.status == "cancelled"
        assert stopped.reservation is None
        cancel = await gw.http.post(f"/v1/responses/{response_id}/cancel", headers=auth(key))
        assert cancel.status_code == 200, cancel.text
        await flushed(gw)
        assert minute_tokens(gw.store, key_id) == reserved


async def test_deleting_a_response_not_begun_gives_the_quota_back(store_url: str) -> None:
    """Deleting a queued background response cancels it: its quota is given back too."""
    async with serve(store_url) as gw:
        key_id, key = gw.key(tpm=TPM)
        first = await create(gw, key, background=True, max_output_tokens=TOKENS)
        assert first.status_code == 200, first.text
        deleted = await gw.http.delete(f"/v1/responses/{first.json()['id']}", headers=auth(key))
        assert deleted.status_code == 200, deleted.text
        await flushed(gw)
        assert minute_tokens(gw.store, key_id) == 0
