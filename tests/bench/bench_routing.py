"""Routing-table refresh at scale (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_routing [--replicas 10000] [--refreshes 5]
        [--churn 100] [--address HOST:PORT]

Starts ``--replicas`` Replica workflows on a throwaway dev server (or the one
at ``--address``; workflows already there are reused), each with the memo and
search attributes a real replica publishes, and no worker: a workflow nobody
runs is listed as Running all the same, so the list costs what it costs with
real engines. The Fleet is started the same way, its memo naming every node.

Then, for the old refresh (``list_workflows`` + ``memo()`` per workflow;
``--skip-old`` leaves it out) and the router's
:class:`~router.control_link.replica_source.TemporalReplicaSource`, once made to list in
full every refresh and once as the router runs it (a full listing, then
deltas: only the replicas that published, started or closed since):

- router CPU (``time.process_time``, and the event loop thread's
  ``time.thread_time``) and wall time per refresh, the table update
  included, with nothing changed between refreshes (for the delta: nothing
  within its look-back margin either);
- the same after ``--churn`` replicas changed phase (the first ``--churn``
  replicas are run by a stand-in workflow that republishes its memo and
  ``ReplicaUpdatedAt`` on a signal, as the Replica workflow does), and after
  ``--churn`` replicas were added (new memos to decode);
- the longest the event loop was blocked during a refresh: a task sleeping
  1 ms in a loop measures how late it wakes, which is the delay a request
  arriving then would see added (the refresh shares the router's loop).

Goal: <= 100 ms of router CPU per refresh, and no long stall of the loop.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from temporalio import workflow
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Worker

from llmgw import contracts
from llmgw import search_attributes as sa
from llmgw.queues import FLEET_WORKFLOW_ID, replica_workflow_id
from llmgw.temporal import connect
from llmgw.types import ModelSpec, ReplicaMemo, ReplicaPhase
from router.control_link.replica_source import DELTA_MARGIN_S, LIST_QUERY, TemporalReplicaSource
from router.control_link.routing import CountedSource, RoutingTable, on_registered_nodes
from tests.harness import free_port, start_devserver

NOBODY = "bench-routing-nobody"  # a task queue no worker polls
PUBLISHERS = "bench-routing-publishers"  # the stand-in workflow's, polled for the churn only
PUBLISH = "publish"
HOUR = 3600.0
NODES = 1250  # eight replicas per node at 10,000
MODELS = 50


def _node_address(n: int) -> str:
    return f"10.{n // 65536}.{n // 256 % 256}.{n % 256}"


def _memo(i: int, phase: ReplicaPhase = ReplicaPhase.READY) -> ReplicaMemo:
    node = i % NODES
    return ReplicaMemo(
        replica_id=f"bench-{i:06d}",
        model=f"model-{i % MODELS:02d}",
        phase=phase,
        node_id=f"node-{node:05d}",
        endpoint=f"http://{_node_address(node)}:{18000 + i // NODES}",
        engine="llama.cpp",
    )


@workflow.defn(name=contracts.REPLICA.name, sandboxed=False)
class PublishingReplica:
    """Started with its memo and search attributes (as the others); on a
    signal republishes them as ``ReplicaWorkflow._publish`` does."""

    @workflow.run
    async def run(self, memo: ReplicaMemo) -> None:
        """Sit until terminated."""
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name=PUBLISH)
    def publish(self, memo: ReplicaMemo) -> None:
        """A phase change."""
        workflow.upsert_memo(contracts.REPLICA_MEMO.encode(memo))
        workflow.upsert_search_attributes(
            [
                sa.REPLICA_STATE.value_set(memo.phase.value),
                sa.REPLICA_UPDATED_AT.value_set(workflow.now()),
            ]
        )


async def _start_replica(client: Client, memo: ReplicaMemo, queue: str = NOBODY) -> None:
    await client.start_workflow(
        contracts.REPLICA.name,
        memo,
        id=replica_workflow_id(memo.replica_id),
        task_queue=queue,
        memo=contracts.REPLICA_MEMO.encode(memo),
        search_attributes=TypedSearchAttributes(
            [
                SearchAttributePair(sa.REPLICA_MODEL, memo.model),
                SearchAttributePair(sa.REPLICA_NODE, memo.node_id),
                SearchAttributePair(sa.REPLICA_STATE, memo.phase.value),
                SearchAttributePair(sa.REPLICA_ENDPOINT, memo.endpoint),
                SearchAttributePair(sa.REPLICA_UPDATED_AT, datetime.now(UTC)),
            ]
        ),
    )


async def _start_many(
    client: Client, memos: list[ReplicaMemo], publishers: int = 0, parallel: int = 64
) -> None:
    """Start ``memos``' workflows; those numbered below ``publishers`` are run
    by the stand-in workflow (a phase change on a signal)."""
    gate = asyncio.Semaphore(parallel)

    async def one(memo: ReplicaMemo) -> None:
        n = int(memo.replica_id.removeprefix("bench-"))
        async with gate:
            await _start_replica(client, memo, PUBLISHERS if n < publishers else NOBODY)

    await asyncio.gather(*(one(m) for m in memos))


async def _listed(client: Client) -> int:
    return (await client.count_workflows(LIST_QUERY)).count


async def _wait_listed(client: Client, count: int) -> None:
    """Visibility lags a start: wait until every replica is listed."""
    async with asyncio.timeout(300):
        while await _listed(client) < count:
            await asyncio.sleep(0.5)


async def populate(client: Client, replicas: int, publishers: int) -> None:
    """Start the Fleet and ``replicas`` Replica workflows, as far as missing."""
    nodes = {f"node-{n:05d}": _node_address(n) for n in range(NODES)}
    fleet = client.get_workflow_handle(FLEET_WORKFLOW_ID)
    try:
        await fleet.describe()
    except Exception:  # not there yet
        await client.start_workflow(
            contracts.FLEET.name,
            id=FLEET_WORKFLOW_ID,
            task_queue=NOBODY,
            memo={contracts.FLEET_NODES_MEMO.key: nodes},
        )
    have = await _listed(client)
    if have < replicas:
        began = time.perf_counter()
        await _start_many(client, [_memo(i) for i in range(have, replicas)], publishers)
        took = time.perf_counter() - began
        print(f"started {replicas - have} Replica workflows in {took:.1f} s")
    await _wait_listed(client, replicas)


class ListAndMemoSource:
    """The refresh before issue 17: the SDK's list, then ``memo()`` per workflow."""

    def __init__(self, client: Client) -> None:
        self._client = client

    async def replicas(self) -> list[ReplicaMemo]:
        found: list[ReplicaMemo] = []
        async for wf in self._client.list_workflows(LIST_QUERY):
            raw = (await wf.memo()).get("replica")
            if isinstance(raw, dict):
                found.append(ReplicaMemo.model_validate(raw))
        desc = await self._client.get_workflow_handle(FLEET_WORKFLOW_ID).describe()
        nodes = (await desc.memo()).get(contracts.FLEET_NODES_MEMO.key)
        assert isinstance(nodes, dict)
        kept, _ = on_registered_nodes(found, {str(k): str(v) for k, v in nodes.items()})
        return kept


async def _stalls_during(work: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """Run ``work`` while a ticker measures the loop's longest stall (seconds):
    how late a 1 ms sleep woke, and the loop thread's CPU time in between (the
    part that is the refresh's own doing, not the OS running someone else)."""
    worst = worst_cpu = 0.0
    done = False

    async def tick() -> None:
        nonlocal worst, worst_cpu
        while not done:
            asked, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - asked - 0.001)
            worst_cpu = max(worst_cpu, time.thread_time() - cpu)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    try:
        await work()
    finally:
        done = True
        await ticker
    return worst, worst_cpu


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:7.1f} ms  max {max(xs) * 1000:7.1f} ms"


Source = TemporalReplicaSource | ListAndMemoSource
CATALOG = {f"model-{m:02d}": ModelSpec(name=f"model-{m:02d}", source="/m") for m in range(MODELS)}


async def _refresh(source: Source, table: RoutingTable) -> int:
    """What refresh_forever does each interval (the catalog read aside): the
    table is rebuilt unless a counted source says nothing changed."""
    if not isinstance(source, CountedSource):
        replicas = await source.replicas()
        table.update(replicas, CATALOG)
        return len(replicas)
    before = source.generation
    replicas = await source.replicas()
    if before != source.generation or not table.replicas:
        table.update(replicas, CATALOG)
    return len(replicas)


async def measure(
    name: str, source: Source, table: RoutingTable, refreshes: int, expect: int
) -> None:
    async def refresh() -> int:
        return await _refresh(source, table)

    first_cpu, first_wall = time.process_time(), time.perf_counter()
    got = await refresh()
    first = (time.process_time() - first_cpu, time.perf_counter() - first_wall)
    if got != expect:
        print(f"  !! {name}: {got} replicas in the table, expected {expect}")
    cpu: list[float] = []
    loop_cpu: list[float] = []
    wall: list[float] = []
    for _ in range(refreshes):
        c, t, w = time.process_time(), time.thread_time(), time.perf_counter()
        await refresh()
        cpu.append(time.process_time() - c)
        loop_cpu.append(time.thread_time() - t)
        wall.append(time.perf_counter() - w)
    stalls: list[float] = []
    stalls_cpu: list[float] = []
    for _ in range(refreshes):

        async def one() -> None:
            await refresh()

        late, busy = await _stalls_during(one)
        stalls.append(late)
        stalls_cpu.append(busy)
    print(f"{name}")
    print(f"  first refresh       cpu {first[0] * 1000:7.1f} ms  wall {first[1] * 1000:7.1f} ms")
    print(f"  steady cpu          {_ms(cpu)}   (whole process: SDK threads too)")
    print(f"  steady loop cpu     {_ms(loop_cpu)}   (the event loop's thread)")
    print(f"  steady wall         {_ms(wall)}")
    print(f"  loop stall, wall    {_ms(stalls)}   (a 1 ms timer's lateness)")
    print(f"  loop stall, cpu     {_ms(stalls_cpu)}   (loop-thread CPU between ticks)")


async def _one(name: str, what: str, source: Source, table: RoutingTable) -> None:
    c, t, w = time.process_time(), time.thread_time(), time.perf_counter()
    await _refresh(source, table)
    print(
        f"{name}\n  {what}  cpu {(time.process_time() - c) * 1000:7.1f} ms"
        f"  loop cpu {(time.thread_time() - t) * 1000:7.1f} ms"
        f"  wall {(time.perf_counter() - w) * 1000:7.1f} ms"
    )


async def change_phases(client: Client, count: int) -> ReplicaPhase:
    """Signal the first ``count`` replicas (the stand-ins) a phase change and
    wait until visibility lists it; their worker is gone before measuring.
    Returns their new phase."""
    draining = f'{LIST_QUERY} AND {sa.REPLICA_STATE.name}="{ReplicaPhase.DRAINING.value}"'
    # A reused server's stand-ins may be draining from a run before: go back.
    phase = (
        ReplicaPhase.READY
        if (await client.count_workflows(draining)).count
        else (ReplicaPhase.DRAINING)
    )
    async with Worker(client, task_queue=PUBLISHERS, workflows=[PublishingReplica]):
        gate = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            async with gate:
                handle = client.get_workflow_handle(replica_workflow_id(_memo(i).replica_id))
                await handle.signal(PUBLISH, _memo(i, phase))

        await asyncio.gather(*(one(i) for i in range(count)))
        want = count if phase is ReplicaPhase.DRAINING else 0
        async with asyncio.timeout(300):
            while (await client.count_workflows(draining)).count != want:
                await asyncio.sleep(0.5)
    return phase


async def main_async(args: argparse.Namespace) -> None:
    if args.address:
        client = await connect(args.address)
        server = None
    else:
        root = Path(tempfile.mkdtemp(prefix="bench-routing-"))
        port = free_port()
        server = start_devserver(root / "temporal.db", port, root / "temporal.log")
        client = await connect(f"127.0.0.1:{port}")
    try:
        await populate(client, args.replicas, args.churn)
        changed_at = time.time()
        full = TemporalReplicaSource(client, full_resync_s=0)  # a full listing every refresh
        delta = TemporalReplicaSource(client, full_resync_s=HOUR)
        sources: list[tuple[str, Source, RoutingTable]] = [
            ("TemporalReplicaSource, full listing every refresh", full, RoutingTable()),
            ("TemporalReplicaSource, delta listing (the router's)", delta, RoutingTable()),
        ]
        if not args.skip_old:
            old = ListAndMemoSource(client)
            sources.insert(0, ("before: list_workflows + memo() per workflow", old, RoutingTable()))
        print(f"{args.replicas} running Replica workflows, {NODES} nodes, {MODELS} models")
        for name, source, table in sources:
            if source is delta:
                # Steady state: nothing published within the delta's look-back.
                await asyncio.sleep(max(0.0, changed_at + DELTA_MARGIN_S + 1 - time.time()))
            await measure(name, source, table, args.refreshes, args.replicas)
        if args.churn:
            phase = await change_phases(client, args.churn)
            print(f"-- after {args.churn} replicas changed phase (their memos are new):")
            for name, source, table in sources:
                await _one(name, f"refresh, {args.churn} changed", source, table)
                listed = {m.replica_id: m.phase for m in table.replicas}
                seen = {listed.get(_memo(i).replica_id) for i in range(args.churn)}
                if seen != {phase}:
                    print(f"  !! {name}: the {args.churn} changed replicas are {seen}")
            await _one(
                sources[-1][0], "the next delta (the same listed again)", delta, sources[-1][2]
            )
            base = await _listed(client)
            await _start_many(client, [_memo(i) for i in range(base, base + args.churn)])
            await _wait_listed(client, base + args.churn)
            print(f"-- after {args.churn} more replicas started (their memos are new):")
            for name, source, table in sources:
                await _one(name, f"refresh with {args.churn} new", source, table)
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=10_000)
    parser.add_argument("--refreshes", type=int, default=5)
    parser.add_argument("--churn", type=int, default=100)
    parser.add_argument("--address", default="", help="a running Temporal to reuse")
    parser.add_argument("--skip-old", action="store_true", help="leave out the old refresh")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
