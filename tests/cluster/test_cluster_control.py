"""The control plane itself under faults (issue 36 §2, scenarios 6 and 8):
Temporal frozen for a minute and then restarted, and one of two control
workers partitioned in the middle of a scale. Serving never waits on
Temporal, a scale asked for meanwhile happens exactly once, and neither
fault leaves a second engine for a replica or an allocation without one."""

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime

import httpx
import pytest
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import replicas
from llmgw.queues import CONTROL_QUEUE, deployment_workflow_id, node_queue, replica_workflow_id
from llmgw.types import ReplicaPhase
from tests.cluster.scenario import (
    CONTROLS,
    NODES,
    REPLICAS,
    ROUTERS,
    Traffic,
    client_of,
    deploy,
    engine_groups,
    ok,
    routable,
    serving,
)
from tests.cluster.stack import MODEL, NAMESPACE, Cluster
from workflows.placement import split_live

FREEZE_S = 60.0


# The engine's environment names its replica (worker_agent.supervisor.engine_title).
async def ledger_matches(cluster: Cluster, client: Client, placed: dict[str, str]) -> list[str]:
    """What is wrong between the ledger, the running replicas and the engines
    (empty when every replica has one allocation on its node and one engine
    process group there, and nothing else is allocated or running)."""
    problems: list[str] = []
    fleet = await replicas.fleet_snapshot(client)
    allocated = {rid: a.node_id for rid, a in fleet.allocations.items()}
    if allocated != placed:
        problems.append(f"ledger {sorted(allocated.items())} != replicas {sorted(placed.items())}")
    if fleet.reservations:
        problems.append(f"reservations left: {sorted(fleet.reservations)}")
    groups = engine_groups(cluster)
    engines = {(rid, node): len(g) for node, per in groups.items() for rid, g in per.items()}
    if engines != {(rid, node): 1 for rid, node in placed.items()}:
        problems.append(f"engines {sorted(engines.items())} != one per replica {sorted(placed)}")
    return problems


async def converged(
    cluster: Cluster, client: Client, want: int, timeout_s: float
) -> dict[str, str]:
    """The replicas once exactly ``want`` serve, every agent is registered,
    and the ledger and the engines match them exactly."""
    last: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    placed = await serving(client, want, 10)
                    up, _ = split_live(await replicas.fleet_snapshot(client), datetime.now(UTC))
                    last = await ledger_matches(cluster, client, placed)
                except TimeoutError:
                    last = [f"not exactly {want} ready"]
                    continue
                except RPCError as exc:
                    # A query to a workflow whose worker was just cut goes
                    # unanswered until the server gives up on its sticky queue.
                    last = [f"query: {exc}"]
                    await asyncio.sleep(0.5)
                    continue
                if not set(NODES) <= set(up):
                    last.append(f"nodes up: {sorted(up)}")
                if not last:
                    return placed
                await asyncio.sleep(0.5)
    except TimeoutError:
        raise AssertionError(f"not converged to {want} in {timeout_s:.0f}s: {last}") from None


async def pollers(client: Client, queue: str, since: datetime) -> set[str]:
    """Identities of the workers that polled ``queue`` for workflow tasks or
    activities at or after ``since`` (the server remembers a poller for
    minutes after its last poll)."""
    seen: set[str] = set()
    for kind in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
        got = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=NAMESPACE, task_queue=TaskQueue(name=queue), task_queue_type=kind
            )
        )
        seen |= {p.identity for p in got.pollers if p.last_access_time.ToDatetime(UTC) >= since}
    return seen


def worker_pid(cluster: Cluster, host: str) -> str:
    """The pid a host's llmgw process polls as (the SDK's identity: pid@hostname)."""
    return str(cluster.processes[host].pid)


async def all_polling(cluster: Cluster, client: Client, timeout_s: float) -> float:
    """Seconds until both control workers poll ``control`` and every agent its
    node queue (each poll seen from now on)."""
    began, since = time.monotonic(), datetime.now(UTC)
    want = {CONTROL_QUEUE: {worker_pid(cluster, h) for h in CONTROLS}}
    want |= {node_queue(n): {worker_pid(cluster, n)} for n in NODES}
    async with asyncio.timeout(timeout_s):
        while True:
            missing = {}
            for queue, pids in want.items():
                have = {identity.split("@")[0] for identity in await pollers(client, queue, since)}
                if pids - have:
                    missing[queue] = pids - have
            if not missing:
                return time.monotonic() - began
            await asyncio.sleep(0.5)


async def holder(cluster: Cluster, client: Client, workflow_id: str) -> str:
    """The control host whose worker ran the workflow's last workflow task."""
    by_pid = {worker_pid(cluster, h): h for h in CONTROLS}
    last = ""
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            last = event.workflow_task_started_event_attributes.identity
    return by_pid.get(last.split("@")[0], "")


async def routers_route(cluster: Cluster, want: set[str], timeout_s: float) -> float:
    """Seconds until each router's routing table (its admin API) holds
    exactly ``want`` as the model's ready replicas."""
    began = time.monotonic()
    headers = {"Authorization": f"Bearer {cluster.admin_key}"}
    async with httpx.AsyncClient(headers=headers, timeout=10) as http, asyncio.timeout(timeout_s):
        while True:
            tables = []
            for router in ROUTERS:
                admin = cluster.router_url(router).removesuffix("/v1") + "/admin/replicas"
                r = await http.get(admin)
                r.raise_for_status()
                views = r.json()
                ready = ReplicaPhase.READY.value
                tables.append(
                    {v["replica_id"] for v in views if v["model"] == MODEL and v["phase"] == ready}
                )
            if all(t == want for t in tables):
                return time.monotonic() - began
            await asyncio.sleep(0.5)


async def started(client: Client) -> set[str]:
    """Every replica the model's deployment ever started, running or not."""
    return {m.replica_id for m in await replicas.list_replicas(client, True) if m.model == MODEL}


def scale(cluster: Cluster, count: int, timeout_s: float = 300) -> str:
    """``llmgw scale MODEL COUNT``, as the operator types it; its output."""
    return ok(cluster.cli("scale", MODEL, str(count), timeout_s=timeout_s))


@pytest.mark.timeout(1200)
async def test_temporal_frozen_then_restarted(cluster: Cluster) -> None:
    """Scenario 6."""
    client = await client_of(cluster)
    key = deploy(cluster, REPLICAS)
    await converged(cluster, client, REPLICAS, 240)
    await routable(cluster)
    before = await started(client)
    async with Traffic(cluster.base_url, key) as traffic:
        await traffic.until(10)
        assert cluster.temporal.proc is not None
        frozen_at = time.monotonic()
        cluster.temporal.proc.freeze()
        try:
            # The operator asks for one more replica while Temporal is frozen.
            asked = asyncio.create_task(
                asyncio.to_thread(cluster.cli, "scale", MODEL, str(REPLICAS + 1), timeout_s=400)
            )
            during = len(traffic.succeeded())
            # The freeze lasts its length whatever happens: nothing to wait for.
            await asyncio.sleep(FREEZE_S)
            during = len(traffic.succeeded()) - during
            cli_done_during = asked.done()
        finally:
            cluster.temporal.proc.thaw()
        thawed_at = time.monotonic()
        done = await asked
        answered_after = time.monotonic() - thawed_at
        print(f"\nscale during the freeze: rc {done.returncode}\n{done.stdout}\n{done.stderr}")
        placed = await converged(cluster, client, REPLICAS + 1, 240)
        scaled_after = time.monotonic() - thawed_at
        await traffic.until(10)

        # Restarted: same database, so every workflow carries on.
        restart_at = time.monotonic()
        cluster.temporal.stop()
        cluster.temporal.start()
        client = await client_of(cluster)
        polling_after = await all_polling(cluster, client, 180)
        again = await converged(cluster, client, REPLICAS + 1, 240)
        restarted_after = time.monotonic() - restart_at
        await traffic.until(10)
        scale(cluster, REPLICAS)
        final = await converged(cluster, client, REPLICAS, 240)
        # The routers follow the scale-down: their tables refresh from the new server.
        routed_after = await routers_route(cluster, set(final), 120)
        await traffic.until(10)
    failed = traffic.failed()
    print(
        f"\n{len(traffic.outcomes)} requests, {len(failed)} failed; {during} served during the"
        f" {FREEZE_S:.0f}s freeze; the scale asked during it answered {answered_after:.1f}s"
        f" after the thaw (returned during the freeze: {cli_done_during}), {REPLICAS + 1} exact"
        f" {scaled_after:.1f}s after the thaw; after the restart every worker polled in"
        f" {polling_after:.1f}s, exact again in {restarted_after:.1f}s;"
        f" both routers routed the scale-down {routed_after:.1f}s after it converged;"
        f" {time.monotonic() - frozen_at:.0f}s in all"
    )
    assert failed == [], failed[:5]
    assert during > 0
    # The command waited for Temporal, said so, and completed after the thaw.
    assert done.returncode == 0, done.stderr
    assert "is not answering" in done.stderr and not cli_done_during
    assert again == placed
    assert set(final) < set(placed)
    # Exactly once: one replica started for the one scale, and no other since.
    assert await started(client) - before == set(placed) - before
    assert len(set(placed) - before) == 1


@pytest.mark.timeout(1200)
async def test_a_control_worker_cut_off_mid_scale(cluster: Cluster) -> None:
    """Scenario 8."""
    client = await client_of(cluster)
    key = deploy(cluster, REPLICAS)
    await converged(cluster, client, REPLICAS, 240)
    await routable(cluster)
    before = await started(client)
    want = 2 * REPLICAS
    async with Traffic(cluster.base_url, key) as traffic:
        await traffic.until(10)
        # The worker that holds the deployment's workflow tasks (sticky: the
        # scale's task goes to it too) is the one cut, as soon as the scale
        # is accepted, while its replicas start.
        host = await holder(cluster, client, deployment_workflow_id(MODEL)) or CONTROLS[0]
        began = time.monotonic()
        scale(cluster, want)
        cluster.bed.cut(host)
        cut_at = time.monotonic()
        new = await started(client) - before
        memos = [await replicas.replica_memo(client, rid) for rid in new]
        ready_at_cut = sum(m is not None and m.phase is ReplicaPhase.READY for m in memos)
        try:
            # Scaling goes on without the cut worker.
            placed = await converged(cluster, client, want, 300)
            without_after = time.monotonic() - cut_at
            held = Counter([await holder(cluster, client, replica_workflow_id(r)) for r in placed])
        finally:
            cluster.bed.heal(host)
        healed_at = time.monotonic()
        polling_after = await all_polling(cluster, client, 180)
        again = await converged(cluster, client, want, 240)
        healed_after = time.monotonic() - healed_at
        await traffic.until(10)
        scale(cluster, REPLICAS)
        final = await converged(cluster, client, REPLICAS, 240)
        await traffic.until(10)
    failed = traffic.failed()
    print(
        f"\n{len(traffic.outcomes)} requests, {len(failed)} failed; cut {host}, which held the"
        f" deployment, {cut_at - began:.1f}s after the scale began, {ready_at_cut} of"
        f" {want - REPLICAS} new replicas ready then ({len(new)} started); {want} exact"
        f" {without_after:.1f}s after the cut, the replicas' last workflow tasks ran on"
        f" {dict(held)}; after the heal {host} polled again in {polling_after:.1f}s,"
        f" exact in {healed_after:.1f}s"
    )
    assert ready_at_cut < want - REPLICAS, "the cut came after the scale was done"
    assert failed == [], failed[:5]
    assert again == placed
    assert set(final) < set(placed)
    # No replica started twice under another id: one start per slot added.
    assert await started(client) - before == set(placed) - before
    assert len(set(placed) - before) == want - REPLICAS
