"""The usage spool (router/usage_spool.py): usage the store could not take,
kept on disk for the next router when this one is killed; a router that is
still running keeps its own."""

import subprocess
import sys
from pathlib import Path

import pytest

from router.accounting import Accountant, Outcome
from router.usage import UsageDelta, UsageKey
from router.usage_spool import UsageSpool, spool_dir
from tests.gateway.test_usage_flush import MODELS, FlakyStore, billed

KEY = UsageKey(1, "m", "2026-12-04")

# A router's spool in another process: it saves, says so, then waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from router.usage import UsageDelta, UsageKey
from router.usage_spool import UsageSpool
spool = UsageSpool(Path(sys.argv[1]), "killed")
spool.open()
spool.save({UsageKey(1, "m", "2026-12-04"): UsageDelta(2, 1, 30, 20)})
print("saved", flush=True)
time.sleep(120)
"""


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


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


def test_a_router_restarted_under_its_own_id_finds_its_spool(tmp_path: Path) -> None:
    first = UsageSpool(tmp_path, "router-1")
    first.open()
    first.save({KEY: UsageDelta(requests=5)})
    first.close()  # stopped with the store still down: the spool stays
    again = UsageSpool(tmp_path, "router-1")
    assert again.open() == {KEY: UsageDelta(requests=5)}
    again.save({KEY: UsageDelta(requests=6)})  # its own file, replaced
    again.close()
    assert UsageSpool(tmp_path, "router-2").open() == {KEY: UsageDelta(requests=6)}


def test_a_router_that_never_needed_the_spool_leaves_nothing(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path / "spool", "r")
    assert spool.open() == {}
    spool.clear()
    spool.close()
    assert not (tmp_path / "spool").exists()


def test_each_store_has_its_own_spool_directory(tmp_path: Path) -> None:
    a = spool_dir(tmp_path, "postgresql://u:p@db1/llmgw")
    assert a == spool_dir(tmp_path, "postgresql://u:p@db1/llmgw")
    assert a != spool_dir(tmp_path, "postgresql://u:p@db2/llmgw")
    assert "p@db1" not in str(a)  # a digest: no password in a path


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
    for model in MODELS:
        first.done(1, model, None, Outcome(prompt_tokens=3, completion_tokens=2))
    store.fail_from(3)  # two rows land, then the store is down
    await first.flush()
    await first.flush()  # still down: the spool is rewritten, not added to
    first.close()  # the router stops (or is killed) before the store is back
    assert files(spool) == ["first.json", "first.lock"]
    store.fail_from(None)
    second = Accountant(store, spool=UsageSpool(spool, "second"))
    await second.open()
    await second.flush()
    second.close()
    assert billed(store) == dict.fromkeys(MODELS, 1)
    assert files(spool) == []
