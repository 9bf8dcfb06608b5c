"""The router's request path when its PostgreSQL store freezes (SIGSTOP) or
stops: keys the router has an answer for keep being served, a request that
needs the store (a quota reservation, a key never seen, an admin call) gets 503
``store_unavailable`` within ``LLMGW_STORE_WAIT_S`` instead of hanging, and
once the store is back everything works again with no usage lost.

Real processes: a PostgreSQL server of the test's own, the mock engine and a
router served as ``llmgw router`` serves it (``python -m
tests.bench.bench_router _router URL``: a static routing table, no Temporal),
called with the official ``openai`` client.
"""

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import httpx
import openai
import pytest

from llmgw.store import Store
from llmgw_cli.procs import wait_for
from router.api.apikeys import create_key
from router.billing import usage, usage_spool
from router.billing.key_policy import KeyPolicy
from tests.bench.fasthttp import MODEL
from tests.bench.procs import free_port, spawn, stop, wait_http
from tests.pg import PgCluster, own_cluster

# A client's own bound: a request the router lets hang fails the test.
CLIENT_TIMEOUT_S = 15.0
ADMIN_KEY = "admin-" + "x" * 32


@pytest.fixture
def own_pg() -> Iterator[PgCluster]:
    with own_cluster() as cluster:
        yield cluster


def ask(port: int, key: str) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key=key,
        timeout=CLIENT_TIMEOUT_S,
        max_retries=0,
    ) as client:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


def refused(port: int, key: str) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        ask(port, key)
    return caught.value


PYTHON = [sys.executable, "-m", "tests.bench.bench_router"]


def start_router(
    store_url: str, work: Path, engine_port: int, log: str
) -> tuple[Popen[bytes], int]:
    """A router on ``store_url`` in front of the mock engine, serving; and its port."""
    port = free_port()
    env = dict(
        os.environ,
        LLMGW_STORE_URL=store_url,
        LLMGW_PORT=str(port),
        LLMGW_KEY_CACHE_TTL_S="0.2",  # answers go stale at once: the outage path
        LLMGW_STORE_WAIT_S="1",
        LLMGW_USAGE_FLUSH_INTERVAL_S="0.2",
        LLMGW_USAGE_SPOOL_DIR=str(work / "spool"),
        LLMGW_ADMIN_KEY=ADMIN_KEY,
    )
    router = spawn([*PYTHON, "_router", f"http://127.0.0.1:{engine_port}"], env, work / log)
    loaded = b'"routing_table_loaded":true'
    if not wait_http(port, "/healthz", lambda d: loaded in d, 60):
        stop(router)
        raise AssertionError((work / log).read_text()[-2000:])
    return router, port


@contextlib.contextmanager
def engine_on(work: Path) -> Iterator[int]:
    """The mock engine; its port."""
    port = free_port()
    engine = spawn([*PYTHON, "_upstream", str(port), "0.001"], dict(os.environ),
                   work / "engine.log")  # fmt: skip
    try:
        yield port
    finally:
        stop(engine)


@contextlib.contextmanager
def router_on(store_url: str, work: Path) -> Iterator[int]:
    """The mock engine and a router in front of it on ``store_url``; the router's port."""
    with engine_on(work) as engine_port:
        router, port = start_router(store_url, work, engine_port, "router.log")
        try:
            yield port
        finally:
            stop(router)


@contextlib.contextmanager
def outage(cluster: PgCluster, fault: str) -> Iterator[None]:
    """The store frozen (every PostgreSQL process stopped by SIGSTOP) or shut
    down for the block; back when it ends."""
    if fault == "stopped":
        cluster.halt()
        try:
            yield
        finally:
            cluster.run()
        return
    frozen = cluster.pids()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


def migrated(cluster: PgCluster) -> tuple[str, Store]:
    """A new database on ``cluster``: its URL, and the store on it, migrated."""
    store_url = cluster.create_database()
    store = Store(store_url)
    store.migrate()
    return store_url, store


def served(port: int, key: str) -> bool:
    """Whether the key's request is served; only the outage's 503 may refuse it."""
    try:
        ask(port, key)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
        return False
    return True


@pytest.mark.parametrize("fault", ["frozen", "stopped"])
def test_a_store_outage_leaves_known_keys_served_and_answers_the_rest_in_time(
    tmp_path: Path, own_pg: PgCluster, fault: str
) -> None:
    store_url, store = migrated(own_pg)
    plain, plain_key = create_key(store, "plain", KeyPolicy())
    _, quota_key = create_key(store, "quota", KeyPolicy(rpm=100_000))
    _, unseen_key = create_key(store, "unseen", KeyPolicy())
    try:
        with router_on(store_url, tmp_path) as port:
            ask(port, plain_key)
            ask(port, quota_key)
            with outage(own_pg, fault):
                # The key the router has an answer for is served from it, again
                # and again (each past its TTL: the store is asked at most once
                # per TTL, and only that request waits for it).
                for _ in range(3):
                    assert ask(port, plain_key).choices[0].message.content
                # What needs the store gets a clear 503 in time, not a hang.
                for key in (quota_key, unseen_key):
                    error = refused(port, key)
                    assert error.status_code == 503
                    assert isinstance(error.body, dict)
                    assert error.body["code"] == "store_unavailable"
                    assert error.response.headers["retry-after"] == "5"
                # The admin API too (its key is the router's own, not stored).
                listed = httpx.get(
                    f"http://127.0.0.1:{port}/admin/keys",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    timeout=CLIENT_TIMEOUT_S,
                )
                assert listed.status_code == 503
                assert listed.json()["error"]["code"] == "store_unavailable"

            # Back: each key is asked of the store again within its TTL.
            assert wait_for(lambda: served(port, quota_key), 60), "the quota key"
            assert wait_for(lambda: served(port, unseen_key), 60), "the unseen key"

            # Usage of the outage was kept and lands once it is over: 1 before
            # and 3 during for the plain key.
            def usage_landed() -> bool:
                rows = usage.query(store, plain.id, MODEL)
                return bool(rows) and rows[0].requests >= 4

            assert wait_for(usage_landed, 30), usage.query(store, plain.id, MODEL)
    finally:
        store.close()
    log = (tmp_path / "router.log").read_text()
    assert "store did not answer a key lookup" in log
    assert all(k not in log for k in (plain_key, quota_key, ADMIN_KEY))  # never in logs


def spooled(spool: Path) -> int:
    """Requests kept in the usage spools under ``spool``."""
    return sum(d.requests for f in spool.rglob("*.json") for d in usage_spool.read(f).values())


@pytest.mark.parametrize("fault", ["frozen", "stopped"])
def test_usage_of_a_router_killed_during_a_store_outage_is_billed_by_the_next(
    tmp_path: Path, own_pg: PgCluster, fault: str
) -> None:
    store_url, store = migrated(own_pg)
    plain, plain_key = create_key(store, "plain", KeyPolicy())
    spool = tmp_path / "spool"

    def requests_billed() -> int:
        rows = usage.query(store, plain.id, MODEL)
        return rows[0].requests if rows else 0

    try:
        with engine_on(tmp_path) as engine_port:
            router, port = start_router(store_url, tmp_path, engine_port, "router.log")
            try:
                ask(port, plain_key)
                assert wait_for(lambda: requests_billed() == 1, 30)
                with outage(own_pg, fault):
                    for _ in range(3):
                        assert ask(port, plain_key).choices[0].message.content
                    # What the flushes could not write (the store refused, or
                    # holds the write's thread) is on disk.
                    assert wait_for(lambda: spooled(spool) == 3, 30)
                    router.kill()
                    router.wait()
            finally:
                stop(router)
            # The store is back; the next router on this host and store bills
            # the killed one's usage, once.
            router, port = start_router(store_url, tmp_path, engine_port, "router2.log")
            try:
                assert wait_for(lambda: requests_billed() >= 4, 30), requests_billed()
                assert requests_billed() == 4
                # Written: the spool is gone, and nothing more was billed.
                assert wait_for(lambda: not any(spool.rglob("*.json")), 30)
                assert requests_billed() == 4
            finally:
                stop(router)
    finally:
        store.close()
    assert "took over the usage of stopped routers" in (tmp_path / "router2.log").read_text()
