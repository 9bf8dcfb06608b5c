"""The usage spool (router/billing/usage_spool.py): usage the store could not take,
kept on disk for the next router when this one is killed; a router that is
still running keeps its own."""

import asyncio
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from llmgw.store import Store
from router.billing import usage_spool
from router.billing.accounting import Accountant, RequestOutcome
from router.billing.usage import UsageDelta, UsageKey
from router.billing.usage_spool import UsageSpool, spool_dir
from tests.gateway.test_usage_flush import MODELS, FlakyStore, billed, serve_one_each

KEY = UsageKey(1, "m", "2026-12-04")

# A router's spool in another process: it saves, says so, then waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from router.billing.usage import UsageDelta, UsageKey
from router.billing.usage_spool import UsageSpool
spool = UsageSpool(Path(sys.argv[1]), "killed")
spool.open()
spool.save({UsageKey(1, "m", "2026-12-04"): UsageDelta(2, 1, 30, 20)})
print("saved", flush=True)
time.sleep(120)
"""


def files(directory: Path) -> list[str]:
    """The file names in ``directory``, each spool's nonce left out."""
    if not directory.exists():
        return []
    return sorted(re.sub(r"-[0-9a-f]{8}\.", ".", p.name) for p in directory.iterdir())


def test_a_killed_router_s_spool_is_taken_over_only_once_it_is_gone(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "saved\n"
            assert UsageSpool(tmp_path, "running").open() == {}  # its router runs
            assert files(tmp_path) == ["killed.json", "killed.lock"]
        finally:
            holder.kill()
    taker = UsageSpool(tmp_path, "next")
    assert taker.open() == {KEY: UsageDelta(2, 1, 30, 20)}
    assert files(tmp_path) == ["next.json", "next.lock"]  # kept as its own until written
    taker.clear()
    assert files(tmp_path) == []


def test_two_routers_with_one_id_keep_a_spool_each(tmp_path: Path) -> None:
    one, two = UsageSpool(tmp_path, "pid-1"), UsageSpool(tmp_path, "pid-1")
    one.save({KEY: UsageDelta(requests=1)})
    two.save({KEY: UsageDelta(requests=2)})
    assert files(tmp_path) == ["pid-1.json", "pid-1.json", "pid-1.lock", "pid-1.lock"]
    assert UsageSpool(tmp_path, "other").open() == {}  # both run
    one.close()  # stopped with its usage kept: the next router bills it
    assert UsageSpool(tmp_path, "pid-1").open() == {KEY: UsageDelta(requests=1)}


def test_a_damaged_spool_is_set_aside_and_routers_still_start(tmp_path: Path) -> None:
    gone = UsageSpool(tmp_path, "gone")
    gone.save({KEY: UsageDelta(requests=1)})
    gone.close()
    next(tmp_path.glob("gone-*.json")).write_bytes(b'[{"key_id": "not a number"')
    assert UsageSpool(tmp_path, "next").open() == {}
    assert files(tmp_path) == ["gone.bad"]


def test_a_router_that_never_needed_the_spool_leaves_nothing(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path / "spool", "r")
    assert spool.open() == {}
    assert not spool.kept
    spool.close()
    assert not (tmp_path / "spool").exists()


def test_each_store_has_its_own_spool_directory_whatever_its_password(tmp_path: Path) -> None:
    a = spool_dir(tmp_path, "postgresql://u:p1@db1/llmgw")
    assert a == spool_dir(tmp_path, "postgresql://u:rotated@db1/llmgw")
    assert a != spool_dir(tmp_path, "postgresql://u:p1@db2/llmgw")
    assert spool_dir(tmp_path, "sqlite:///a.db") != spool_dir(tmp_path, "sqlite:///b.db")


@pytest.fixture
def store(tmp_path: Path) -> FlakyStore:
    s = FlakyStore(f"sqlite:///{tmp_path / 'store.db'}")
    s.migrate()
    return s


async def test_usage_a_stopped_router_could_not_write_is_billed_once_by_the_next(
    store: FlakyStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    first = Accountant(store, spool=UsageSpool(spool, "first"))
    await first.open()
    serve_one_each(first)
    store.fail_from(3)  # two rows land, then the store is down
    await first.flush()
    await first.flush()  # still down: the spool is rewritten, not added to
    await first.close()  # the router stops (or is killed) before the store is back
    assert files(spool) == ["first.json", "first.lock"]
    store.fail_from(None)
    await next_router_bills_once(store, spool)


async def next_router_bills_once(store: FlakyStore, spool: Path) -> None:
    """The next router on the spool takes it over and writes it: each
    request of ``serve_one_each`` billed once, and nothing left kept."""
    second = Accountant(store, spool=UsageSpool(spool, "second"))
    await second.open()
    await second.flush()
    await second.close()
    assert billed(store) == dict.fromkeys(MODELS, 1)
    assert files(spool) == []


class SlowStore(FlakyStore):
    """Each row's write takes a while: a flush can be cancelled part-way."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.writing = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def session(self) -> AbstractContextManager[Session]:
        self.loop.call_soon_threadsafe(self.writing.set)
        time.sleep(0.05)
        return super().session()


async def test_a_flush_cancelled_part_way_leaves_the_spool_as_true_as_the_store(
    tmp_path: Path,
) -> None:
    store = SlowStore(f"sqlite:///{tmp_path / 'store.db'}")
    store.migrate()
    spool = tmp_path / "spool"
    first = Accountant(store, spool=UsageSpool(spool, "first"))
    serve_one_each(first)
    store.fail_from(1)
    await first.flush()  # the store is down: all four kept
    store.fail_from(None)
    store.writing.clear()
    flushing = asyncio.create_task(first.flush())
    await store.writing.wait()
    flushing.cancel()  # as shutdown cancels the flush loop, mid-write
    with pytest.raises(asyncio.CancelledError):
        await flushing
    await first.flush()  # shutdown's last flush
    await first.close()
    await next_router_bills_once(store, spool)


class FrozenStore(FlakyStore):
    """A store that can freeze: a session waits until ``thaw``, then works,
    or fails as the connection of a router killed meanwhile would."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.answering = threading.Event()
        self.answering.set()
        self.dead = False
        self.cut_off = threading.Event()  # a session failed as dead
        self.sessions = 0

    def freeze(self) -> None:
        self.answering.clear()

    def thaw(self, dead: bool = False) -> None:
        self.dead = dead
        self.answering.set()

    def session(self) -> AbstractContextManager[Session]:
        self.sessions += 1
        self.answering.wait()
        if self.dead:
            self.cut_off.set()
            raise OperationalError("UPDATE usage_daily", {}, OSError("connection reset"))
        return super().session()


@pytest.fixture
def frozen(tmp_path: Path) -> Iterator[FrozenStore]:
    s = FrozenStore(f"sqlite:///{tmp_path / 'store.db'}")
    s.migrate()
    yield s
    s.thaw()  # no thread left waiting


def spooled(spool: Path) -> dict[str, int]:
    """Requests per model in the spool files."""
    out: dict[str, int] = {}
    for f in spool.glob("*.json"):
        for key, delta in usage_spool.read(f).items():
            out[key.model] = out.get(key.model, 0) + delta.requests
    return out


async def frozen_in_a_write(
    frozen: FrozenStore, spool: Path, name: str
) -> tuple[Accountant, UsageSpool]:
    """A router (and its spool) whose flush met the store frozen: the flush
    has returned and its batch (a request to each model) waits in the
    write's thread."""
    kept = UsageSpool(spool, name)
    accountant = Accountant(frozen, spool=kept, write_wait_s=0.2)
    serve_one_each(accountant)
    frozen.freeze()
    await accountant.flush()
    return accountant, kept


async def flush_until_spool_gone(accountant: Accountant, spool: Path) -> None:
    async with asyncio.timeout(10):
        while files(spool):
            await accountant.flush()


async def test_a_frozen_store_holds_the_write_s_thread_not_the_flush(
    frozen: FrozenStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    accountant, _ = await frozen_in_a_write(frozen, spool, "r")
    accountant.done(1, "m1", None, RequestOutcome())
    await accountant.flush()  # returns too
    assert frozen.sessions == 1  # no second batch while the first may still land
    assert spooled(spool) == {"m1": 2, "m2": 1, "m3": 1, "m4": 1}  # all that is owed
    frozen.thaw()
    await flush_until_spool_gone(accountant, spool)  # the first batch, then the second
    await accountant.close()
    assert billed(frozen) == {"m1": 2, "m2": 1, "m3": 1, "m4": 1}


async def test_once_a_held_write_lands_with_nothing_after_it_the_spool_goes(
    frozen: FrozenStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    accountant, _ = await frozen_in_a_write(frozen, spool, "r")
    assert spooled(spool) == dict.fromkeys(MODELS, 1)
    frozen.thaw()
    await flush_until_spool_gone(accountant, spool)
    await accountant.close()
    await next_router_bills_once(frozen, spool)  # nothing left to bill again


async def test_a_router_stopping_while_its_write_is_held_keeps_its_spool_until_it_lands(
    frozen: FrozenStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    accountant, _ = await frozen_in_a_write(frozen, spool, "stopping")
    closing = asyncio.create_task(accountant.close())  # a rolling restart: it stops
    for _ in range(3):
        await asyncio.sleep(0)  # a few loop turns: close() has run as far as it can
    assert not closing.done()
    # Meanwhile the next router starts: the spool is not its to take yet.
    assert UsageSpool(spool, "next").open() == {}
    frozen.thaw()
    async with asyncio.timeout(10):
        await closing
    await next_router_bills_once(frozen, spool)


async def test_usage_of_a_router_killed_while_the_store_is_frozen_is_billed_once(
    frozen: FrozenStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    _, kept = await frozen_in_a_write(frozen, spool, "first")
    kept.close()  # killed: the lock goes with the process, its write never lands
    frozen.thaw(dead=True)
    assert await asyncio.to_thread(frozen.cut_off.wait, 10)  # its thread gave up
    frozen.dead = False
    await next_router_bills_once(frozen, spool)


# A router serving with the store up, killed before its next flush: it has
# queued a request to each model (answered) and never flushes (a long interval).
SERVED_THEN_KILLED = """
import asyncio, sys
from pathlib import Path
from llmgw.store import Store
from router.billing.accounting import Accountant
from router.billing.usage_spool import UsageSpool
from tests.gateway.test_usage_flush import serve_one_each

async def main() -> None:
    store = Store(sys.argv[2])
    accountant = Accountant(store, spool=UsageSpool(Path(sys.argv[1]), "killed"))
    await accountant.open()
    serve_one_each(accountant)
    print("served", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def _serve_then_kill(spool: Path, url: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SERVED_THEN_KILLED, str(spool), url],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    ) as router:
        try:
            assert router.stdout is not None
            assert router.stdout.readline() == "served\n"
        finally:
            router.kill()


async def test_a_router_killed_between_flushes_loses_none_of_its_answered_usage(
    store: FlakyStore, tmp_path: Path
) -> None:
    """Found by the cluster's router-kill scenario (tests/cluster/test_cluster_gateway.py):
    a router SIGKILLed with the store up lost its last interval's usage (17 of
    107 requests unbilled), since only a flush the store refused was spooled."""
    spool = tmp_path / "spool"
    await asyncio.to_thread(_serve_then_kill, spool, f"sqlite:///{tmp_path / 'store.db'}")
    assert billed(store) == {}
    await next_router_bills_once(store, spool)


async def test_a_failed_save_leaves_no_journal_to_bill_again(
    store: FlakyStore, tmp_path: Path
) -> None:
    """Found by review: the journals a save was to replace were forgotten
    when it failed (the disk full), so the next save folded their usage in
    and left them too: taken over, billed twice."""
    spool = tmp_path / "spool"
    first = Accountant(store, spool=UsageSpool(spool, "first"))
    store.fail_from(1)  # the store is down: everything stays owed
    first.done(1, "m1", None, RequestOutcome())
    aside = next(spool.glob("*.lock")).with_suffix(".json.tmp")
    aside.mkdir()  # the save's file cannot be written
    await first.flush()  # the save fails (a warning); the usage stays owed
    aside.rmdir()
    first.done(1, "m1", None, RequestOutcome())
    await first.flush()  # saved now
    await first.close()  # killed before the store is back
    store.fail_from(None)
    second = Accountant(store, spool=UsageSpool(spool, "second"))
    await second.open()
    await second.flush()
    await second.close()
    assert billed(store) == {"m1": 2}
    assert files(spool) == []


async def test_a_clear_waits_for_a_save_still_in_its_thread(
    frozen: FrozenStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a flush cancelled while its save ran in the spool's
    thread left that save running, and the next flush (nothing owed) cleared
    the spool at once; the save landed after it, a stale spool of usage
    already billed, billed again once that router was killed."""
    spool = tmp_path / "spool"
    saving, go_on = threading.Event(), threading.Event()
    dump = usage_spool._dump

    def slow_dump(pending: usage_spool.Pending) -> bytes:
        saving.set()
        go_on.wait(10)
        return dump(pending)

    monkeypatch.setattr(usage_spool, "_dump", slow_dump)
    kept = UsageSpool(spool, "first")
    accountant = Accountant(frozen, spool=kept, write_wait_s=0.2)
    try:
        serve_one_each(accountant)
        frozen.freeze()
        flushing = asyncio.create_task(accountant.flush())  # its write is held: it saves
        assert await asyncio.to_thread(saving.wait, 10)
        flushing.cancel()  # as shutdown cancels the flush loop, mid-save
        with pytest.raises(asyncio.CancelledError):
            await flushing
        frozen.thaw()  # the write lands: nothing is owed
        async with asyncio.timeout(10):
            while billed(frozen) != dict.fromkeys(MODELS, 1):
                await asyncio.sleep(0.01)
            clearing = asyncio.create_task(accountant.flush())
            while kept.kept:  # until that flush has cleared the spool (or queued its clear)
                await asyncio.sleep(0.01)
    finally:
        go_on.set()
    await clearing
    await flush_until_spool_gone(accountant, spool)
    accountant.done(1, "m1", None, RequestOutcome())
    kept.close()  # killed before its next flush
    await next_router_bills_once_more(frozen, spool, {"m1": 2, "m2": 1, "m3": 1, "m4": 1})


async def next_router_bills_once_more(store: FlakyStore, spool: Path, want: dict[str, int]) -> None:
    second = Accountant(store, spool=UsageSpool(spool, "second"))
    await second.open()
    await second.flush()
    await second.close()
    assert billed(store) == want
    assert files(spool) == []


def test_a_journal_with_a_damaged_line_is_set_aside_whole(tmp_path: Path) -> None:
    """Found by review: the rows before a damaged line were billed, yet the
    journal was set aside as not billed."""
    gone = UsageSpool(tmp_path, "gone")
    gone.save({KEY: UsageDelta(requests=1)})
    gone.note(KEY, UsageDelta(requests=2))
    gone.close()
    journal = next(tmp_path.glob("gone-*.adds"))
    with journal.open("ab") as f:
        f.write(b'{"key_id": "not a number"}\n' + journal.read_bytes())
    assert UsageSpool(tmp_path, "next").open() == {KEY: UsageDelta(requests=1)}
    assert [f for f in files(tmp_path) if f.startswith("gone")] == [
        re.sub(r"-[0-9a-f]{8}\.", ".", journal.name) + ".bad"
    ]


# A router whose journal hits the file size limit mid-row (as a full disk
# would cut a write short), then can write again.
CUT_SHORT = """
import resource, signal, sys
from pathlib import Path
from router.billing.usage import UsageDelta, UsageKey
from router.billing.usage_spool import UsageSpool
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
spool = UsageSpool(Path(sys.argv[1]), "cut")
key = UsageKey(1, "m", "2026-12-04")
spool.hold()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
noted = 0
try:
    while True:
        spool.note(key, UsageDelta(requests=1))
        noted += 1
except OSError:
    pass
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
for _ in range(3):
    spool.note(key, UsageDelta(requests=1))
    noted += 1
print(noted)
"""


def test_a_journal_write_cut_short_costs_only_its_own_row(tmp_path: Path) -> None:
    """Found by review: a short write left half a row, the next row was
    appended to it, and the journal, unreadable, was set aside whole."""
    done = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    noted = int(done.stdout)
    assert noted > 3
    assert UsageSpool(tmp_path, "next").open() == {KEY: UsageDelta(requests=noted)}


async def test_each_change_to_the_spool_directory_is_made_durable(
    store: FlakyStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the journals a save replaced were removed after the
    directory's last fsync: a power loss could bring them back beside the
    spool that holds their usage, billed twice."""
    spool = tmp_path / "spool"
    synced: list[list[str]] = []
    fsync_dir = usage_spool._fsync_dir

    def recorded(directory: Path) -> None:
        fsync_dir(directory)
        synced.append(files(directory))

    monkeypatch.setattr(usage_spool, "_fsync_dir", recorded)
    first = Accountant(store, spool=UsageSpool(spool, "first"))
    store.fail_from(1)
    serve_one_each(first)
    await first.flush()  # saved: the journal goes
    assert files(spool) == ["first.json", "first.lock"]
    assert synced[-1] == files(spool)
    store.fail_from(None)
    await first.flush()  # cleared
    await first.close()
    assert synced[-1] == files(spool) == []


async def test_rows_a_failed_write_gives_back_are_written_before_rows_queued_after(
    frozen: FrozenStore, tmp_path: Path
) -> None:
    """A router's usage lands in the order it was queued, so a request's row
    billed means the rows queued before it are billed (the cluster tests'
    fence: tests/cluster/test_cluster_gateway.py)."""
    accountant = Accountant(frozen, spool=UsageSpool(tmp_path / "spool", "r"), write_wait_s=0.2)
    accountant.done(1, "m1", None, RequestOutcome())
    frozen.freeze()
    await accountant.flush()  # m1's write is held
    accountant.done(1, "m2", None, RequestOutcome())
    frozen.thaw(dead=True)  # m1's write fails: m1 is owed again
    assert await asyncio.to_thread(frozen.cut_off.wait, 10)
    frozen.dead = False
    frozen.fail_from(2)  # the next batch's first row lands, then the store fails
    rows = Store(f"sqlite:///{tmp_path / 'store.db'}")  # read past the failing one
    async with asyncio.timeout(10):
        while not billed(rows):
            await accountant.flush()
    assert billed(rows) == {"m1": 1}
    frozen.fail_from(None)
    await accountant.flush()
    await accountant.close()
    assert billed(rows) == {"m1": 1, "m2": 1}
