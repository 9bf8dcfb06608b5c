"""Nodes cut off over a real network (issue 36 §2, scenarios 3 and 4): an
agent cut from Temporal only keeps serving and adopts its engine when back;
a node cut from everything costs only the requests in flight on it, its
replica is replaced elsewhere, and the surplus drains when it returns."""

import asyncio
import time
from datetime import UTC, datetime

import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.types import ReplicaPhase, ReplicaTimeouts
from tests.cluster.scenario import (
    NODES,
    REPLICAS,
    Traffic,
    client_of,
    deploy_with,
    engine_groups,
    routable,
    serving,
)
from tests.cluster.stack import Cluster
from tests.harness import wait_phase
from workflows.placement import split_live

# Routers stop sending to a node cut off within this: a passive ejection
# after a failed connect, then the replica leaves the routing table.
STOP_SENDING_S = 15.0
# The replica timers a node loss runs on, shortened (defaults: a 10 s
# heartbeat, 60 s of engine silence): the same path, a third of the wait.
QUICK = ReplicaTimeouts(
    heartbeat_s=5, probe_interval_s=2, engine_unreachable_s=20, schedule_to_start_s=10,
    place_retry_s=1, place_attempts=1000,
)  # fmt: skip


@pytest.fixture(scope="module")
async def deployed(cluster: Cluster) -> str:
    """The module's deployment, started with ``QUICK``; the client key."""
    return await deploy_with(cluster, await client_of(cluster), QUICK)


def engines_on(cluster: Cluster, node: str) -> int:
    """Engine process groups running on ``node`` (one a replica)."""
    return sum(len(groups) for groups in engine_groups(cluster, [node])[node].values())


async def test_an_agent_cut_from_temporal_keeps_serving_and_adopts(
    cluster: Cluster, deployed: str
) -> None:
    """Scenario 3."""
    client = await client_of(cluster)
    key = deployed
    placed = await serving(client, REPLICAS, 240)
    await routable(cluster)
    rid, node = min(placed.items())
    async with Traffic(cluster.base_url, key) as traffic:
        await traffic.until(10)
        cluster.bed.cut_between(node, "temporal")
        try:
            lost_after = await wait_phase(client, rid, ReplicaPhase.NODE_LOST, 120)
            # Still serving from the lost node, through both routers.
            await traffic.until(20)
            served = {o.replica for o in traffic.succeeded()[-20:]}
        finally:
            cluster.bed.heal_between(node, "temporal")
        back_after = await wait_phase(client, rid, ReplicaPhase.READY, 120)
        await traffic.until(10)
    print(f"\nnode lost {lost_after:.1f}s after the cut, ready {back_after:.1f}s after the heal")
    assert traffic.failed() == [], traffic.failed()[:5]
    assert rid in served, f"the cut-off node's replica served nothing: {served}"
    assert await serving(client, REPLICAS, 60) == placed
    final = await replicas.status_of(client, rid)
    assert final is not None
    assert [h.phase for h in final.history][-2:] == [ReplicaPhase.NODE_LOST, ReplicaPhase.READY]
    assert "(same pid)" in final.history[-1].detail
    assert [engines_on(cluster, n) for n in sorted(set(placed.values()))] == [1, 1, 1, 1]


async def test_a_node_cut_off_costs_only_its_requests_in_flight(
    cluster: Cluster, deployed: str
) -> None:
    """Scenario 4."""
    client = await client_of(cluster)
    key = deployed
    placed = await serving(client, REPLICAS, 240)
    await routable(cluster)
    lost, node = max(placed.items())
    async with Traffic(cluster.base_url, key) as traffic:
        await traffic.until(10)
        cut_at = time.monotonic()
        cluster.bed.cut(node)
        try:
            replaced = await _until_replaced(client, lost, 240)
            replaced_after = time.monotonic() - cut_at
            await traffic.until(20)
        finally:
            cluster.bed.heal(node)
        healed_at = time.monotonic()
        # Back, the node's agent stops the engine whose replica was replaced.
        after_heal = await _converged(cluster, client, 120)
        drained_after = time.monotonic() - healed_at
        await traffic.until(10)
    failed = traffic.failed()
    late = [o for o in failed if o.started >= cut_at]
    settled = traffic.started_after(cut_at + STOP_SENDING_S)
    slow = [o for o in settled if o.ok and o.ended - o.started > 4.0]
    print(
        f"\n{len(traffic.outcomes)} requests, {len(failed)} failed (in flight at the cut);"
        f" replaced {replaced_after:.1f}s after the cut; exact again {drained_after:.1f}s"
        f" after the heal; slowest after {STOP_SENDING_S:.0f}s:"
        f" {max((o.ended - o.started for o in settled), default=0):.2f}s"
    )
    assert late == [], f"requests sent after the cut failed: {late[:5]}"
    assert all(o.started < cut_at <= o.ended for o in failed), "a failure not in flight at the cut"
    assert slow == [], f"routers still tried the cut node: {slow[:5]}"
    assert lost not in after_heal and node not in replaced.values()


async def _converged(cluster: Cluster, client: Client, timeout_s: float) -> dict[str, str]:
    """The replicas once exactly the desired serve, every node's agent is
    registered again, and each node runs one engine per replica placed there."""
    async with asyncio.timeout(timeout_s):
        while True:
            placed = await serving(client, REPLICAS, timeout_s)
            fleet = await replicas.fleet_snapshot(client)
            up, _ = split_live(fleet, datetime.now(UTC))
            live = set(NODES) <= set(up)
            engines = {n: engines_on(cluster, n) for n in NODES}
            if live and engines == {n: list(placed.values()).count(n) for n in NODES}:
                return placed
            await asyncio.sleep(0.5)


async def _until_replaced(client: Client, lost: str, timeout_s: float) -> dict[str, str]:
    """The replicas once exactly the desired serve and ``lost`` is not one of them."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                now = await serving(client, REPLICAS, 5)
            except TimeoutError:
                continue
            if lost not in now:
                return now
            await asyncio.sleep(0.5)
