"""The gateway's own faults (issue 36 §2, scenarios 5 and 7): a router
killed under traffic, and the store restarted under traffic. In both, every
request a client saw succeed is billed exactly once in the store's usage
rows, and a key's quota counts at least what its requests took (a killed
router's last settlements are lost with it: their reservations stay
counted, the safe side).

Usage rows are per key, model and UTC day, with no request id, so billing is
checked by count: each scenario has a key of its own, every request carries
the same prompt and ``max_tokens``, and the key's rows must add up to the
requests the clients saw succeed, read once every router's usage has landed
(``_fenced``). A request the router finished whose answer the kill kept from
the client may be billed too (it ran); nothing else may.
"""

import asyncio
import time
from dataclasses import dataclass

import httpx
import psycopg

from llmgw.settings import RouterSettings
from tests.cluster.scenario import (
    REPLICAS,
    Traffic,
    client_of,
    deploy,
    ok,
    routable,
    serving,
)
from tests.cluster.stack import MODEL, Cluster

ROUTER_ENV = {"LLMGW_EXPOSE_REPLICA_HEADER": "true"}
# HAProxy's health checks (the guide: inter 1s fall 2) mark a dead router
# down within about this; before that, connection failures are retried.
DETECT_S = 3.0
# The routers' usage flush interval (LLMGW_USAGE_FLUSH_INTERVAL_S, 1 s) and
# a write's bound, with room for a loaded machine: usage lands within this.
BILLED_WITHIN_S = 60.0
# The store stays down for several key cache TTLs: every router asks the
# store again for the key meanwhile, and gets no answer.
OUTAGE_S = 3 * float(RouterSettings.model_fields["key_cache_ttl_s"].default)


@dataclass(frozen=True)
class Billed:
    """A key's usage rows, summed over days; and its quota's period tokens."""

    requests: int
    errors: int
    tokens: int
    period_tokens: int


def _store(cluster: Cluster) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        host=cluster.pg.address,
        port=5432,
        user="llmgw",
        password=cluster.pg.password,
        dbname="llmgw",
        autocommit=True,
        connect_timeout=5,
    )


def key_id_of(cluster: Cluster, name: str) -> int:
    """The id of the client key named ``name``."""
    with _store(cluster) as conn:
        row = conn.execute("SELECT id FROM apikey WHERE name = %s", (name,)).fetchone()
    assert row is not None, name
    return int(str(row[0]))


def billed(cluster: Cluster, key_id: int) -> Billed:
    """What the store holds for ``key_id``."""
    with _store(cluster) as conn:
        usage = conn.execute(
            "SELECT coalesce(sum(requests), 0), coalesce(sum(errors), 0),"
            " coalesce(sum(prompt_tokens + completion_tokens), 0)"
            " FROM usagedaily WHERE key_id = %s",
            (key_id,),
        ).fetchone()
        quota = conn.execute(
            "SELECT period_tokens FROM quotawindow WHERE key_id = %s", (key_id,)
        ).fetchone()
    assert usage is not None
    requests, errors, tokens = (int(str(v)) for v in usage)
    period = int(str(quota[0])) if quota is not None else 0
    return Billed(requests, errors, tokens, period)


def new_key(cluster: Cluster, name: str, *quota: str) -> tuple[str, int]:
    """A client key for the model (quota options as ``llmgw keys create``'s); it and its id."""
    made = ok(cluster.cli("keys", "create", name, "--models", MODEL, *quota))
    return made.strip().splitlines()[-1], key_id_of(cluster, name)


@dataclass(frozen=True)
class Sent:
    """One request sent past the balancer: its error ("" when it succeeded)
    and the tokens its answer says it took."""

    error: str = ""
    tokens: int = 0

    @property
    def ok(self) -> bool:
        """Whether it succeeded."""
        return not self.error


async def _completion(url: str, key: str) -> Sent:
    """One of the traffic's requests, sent to ``url`` (a router, past the balancer)."""
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{url}/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "the river", "max_tokens": 4},
        )
    if r.status_code != 200:
        return Sent(f"{r.status_code} {r.text[:200]}")
    return Sent(tokens=int(r.json()["usage"]["total_tokens"]))


async def _fenced(cluster: Cluster, name: str, routers: list[str]) -> float:
    """The usage ``routers`` had is all in the store once this returns; how
    long it took.

    After the traffic, a request of a fence key of its own straight to each
    router, then a wait until each fence is billed: a router writes its rows
    in the order it queued them (router/billing/usage_batches.py), so once
    its fence is billed, so is all the usage it had before (recovered from a
    killed router's spool included, which a router queues before it serves).
    A fence a router makes a key of its own tells each router's apart, where
    one key's count could add a double bill to a fence not yet landed."""
    fences = {host: new_key(cluster, f"{name}-fence-{host}") for host in routers}
    for host, (fence, _) in fences.items():
        done = await _completion(cluster.router_url(host), fence)
        assert done.ok, done.error
    began = time.monotonic()
    async with asyncio.timeout(BILLED_WITHIN_S):
        for _, fence_id in fences.values():
            while (await asyncio.to_thread(billed, cluster, fence_id)).requests < 1:
                await asyncio.sleep(0.2)
    for host, (_, fence_id) in fences.items():
        fenced = await asyncio.to_thread(billed, cluster, fence_id)
        assert fenced.requests == 1, (host, fenced)
    return time.monotonic() - began


async def _router_up(cluster: Cluster, host: str, timeout_s: float = 60) -> None:
    url = cluster.router_url(host).removesuffix("/v1") + "/healthz"
    async with httpx.AsyncClient(timeout=2) as http, asyncio.timeout(timeout_s):
        while True:
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)


async def test_a_router_killed_costs_its_requests_in_flight_and_no_usage(
    cluster: Cluster,
) -> None:
    """Scenario 5. The fault is SIGKILL of the router process on r1, the
    crash: the host stays, so its kernel refuses connections to the dead
    port at once (HAProxy's retry-on conn-failure sends those to r2) and the
    spool on its disk is there for the router started on r1 again, as
    systemd's Restart= does. (A host cut off is a partition, scenario 4's
    kind: its router's usage waits in memory and is written when it returns.)

    The key has a token budget: every request reserves in the store, so the
    quota's count and the usage rows are both checked across the two routers.
    """
    client = await client_of(cluster)
    deploy(cluster)
    await serving(client, REPLICAS, 240)
    await routable(cluster)
    key, key_id = new_key(cluster, "gw-router-kill", "--budget", "100000000")
    probe = await _completion(cluster.router_url("r2"), key)
    assert probe.ok, probe.error
    router = cluster.processes["r1"]
    async with Traffic(cluster.base_url, key, workers=4) as traffic:
        await traffic.until(40)
        killed_at = time.monotonic()
        router.kill()
        # The signal is sent, not yet acted on: a request sent meanwhile can
        # reach r1 before its sockets close, in flight at the kill too.
        await asyncio.to_thread(router.popen.wait, 10)
        dead_at = time.monotonic()
        await traffic.until(60, timeout_s=120)
    outcomes = list(traffic.outcomes)
    failed = [o for o in outcomes if not o.ok]
    in_flight = [o for o in failed if o.started < dead_at and killed_at <= o.ended]
    after = [o for o in failed if o.started >= dead_at]
    cluster.start_role("router", "r1", ROUTER_ENV)
    await _router_up(cluster, "r1")
    waited = await _fenced(cluster, "gw-router-kill", ["r2", "r1"])
    succeeded = [o for o in outcomes if o.ok]
    want = 1 + len(succeeded)  # the probe, the traffic
    got = await asyncio.to_thread(billed, cluster, key_id)
    print(
        f"\n{len(outcomes)} requests, {len(failed)} failed ({len(in_flight)} in flight at the"
        f" kill, {len(after)} sent after it); billed {got.requests} of {want} requests,"
        f" {got.tokens} tokens ({waited:.1f}s after the fences);"
        f" the budget counts {got.period_tokens}"
    )
    assert after == [], f"requests sent after the kill failed: {after[:5]}"
    assert failed == in_flight, failed[:5]
    # Billed exactly once: what succeeded, and at most the requests the kill
    # cut off after the router had finished them (none of them here: each
    # would be billed as a success the client never saw).
    assert want <= got.requests <= want + len(in_flight), got
    assert got.errors == 0, got
    # The budget took at least each finished request's tokens: the
    # settlements r1 had not written when killed are lost, and their
    # reservations stay counted (the safe side).
    assert got.period_tokens >= got.tokens, got


async def test_the_store_restarted_keeps_keys_and_bills_its_outage_once(
    cluster: Cluster,
) -> None:
    """Scenario 7. PostgreSQL stopped (fast shutdown: its clients cut off)
    under traffic, then started on the same data. A key without quotas needs
    the store for nothing on the request path once a router has checked it,
    so it keeps being served through the outage, on the routers' last answer
    (LLMGW_KEY_STALE_S, 1 hour); usage meanwhile is queued and spooled, and
    billed once the store is back. A key with quotas needs the store for its
    reservation: 503 store_unavailable with Retry-After, then served again."""
    client = await client_of(cluster)
    deploy(cluster)
    await serving(client, REPLICAS, 240)
    await routable(cluster)
    key, key_id = new_key(cluster, "gw-store-restart")
    quota_key, quota_id = new_key(cluster, "gw-store-restart-quota", "--rpm", "100000")
    probes = [await _completion(cluster.router_url(h), key) for h in ("r1", "r2")]
    assert all(p.ok for p in probes), probes
    for h in ("r1", "r2"):
        assert (await _completion(cluster.router_url(h), quota_key)).ok
    async with Traffic(cluster.base_url, key, workers=3) as traffic:
        await traffic.until(30)
        stopped_at = time.monotonic()
        cluster.pg.stop()
        try:
            # The fault's length, not a wait for a condition: checked keys
            # keep working all through it (asserted from the outcomes).
            await asyncio.sleep(OUTAGE_S)
            refused = [await _completion(cluster.router_url(h), quota_key) for h in ("r1", "r2")]
            down_for = time.monotonic() - stopped_at
        finally:
            cluster.pg.start()
        started_at = time.monotonic()
        await traffic.until(30, timeout_s=120)
    outcomes = list(traffic.outcomes)
    failed = [o for o in outcomes if not o.ok]
    during = [o for o in outcomes if stopped_at <= o.started < started_at]
    back = await _completion(cluster.router_url("r1"), quota_key)
    waited = await _fenced(cluster, "gw-store-restart", ["r1", "r2"])
    succeeded = [o for o in outcomes if o.ok]
    want = len(probes) + len(succeeded)
    got = await asyncio.to_thread(billed, cluster, key_id)
    print(
        f"\n{len(outcomes)} requests, {len(failed)} failed; {len(during)} sent while the store"
        f" was down ({down_for:.1f}s); billed {got.requests} of {want} requests,"
        f" {got.tokens} tokens ({waited:.1f}s after the fences);"
        f" the quota key: {[r.error[:40] for r in refused]} down, {back.error or 'ok'} back"
    )
    assert failed == [], failed[:5]
    assert len(during) >= 30 and during[-1].started - stopped_at >= OUTAGE_S - 1
    assert (got.requests, got.errors) == (want, 0), got
    assert all(r.error.startswith("503 ") and "store_unavailable" in r.error for r in refused)
    assert back.ok, back.error
    quota = await asyncio.to_thread(billed, cluster, quota_id)
    assert quota.requests - quota.errors == 3, quota  # before, and once back
