"""The routing table's refresh off Temporal: memos decoded only when they change,
the same table kept (not rebuilt) while nothing changes.

The figures at 10,000 replicas are tests/bench/bench_routing.py's.
"""

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from sqlalchemy.exc import OperationalError
from temporalio.client import Client, WorkflowHandle

from llmgw import contracts
from llmgw.queues import replica_workflow_id
from llmgw.types import ModelSpec, ReplicaMemo, ReplicaPhase
from router.control_link.replica_source import TemporalReplicaSource
from router.control_link.routing import RoutingTable, refresh_forever


def _memo(rid: str, phase: ReplicaPhase) -> ReplicaMemo:
    # No endpoint: kept whatever nodes the Fleet registered (nothing is sent to it).
    return ReplicaMemo(replica_id=rid, model=f"model-{rid}", phase=phase)


async def _start(client: Client, memo: ReplicaMemo) -> WorkflowHandle[object, object]:
    return await client.start_workflow(
        contracts.REPLICA.name,
        id=replica_workflow_id(memo.replica_id),
        task_queue=f"nobody-{memo.replica_id}",  # no worker: it just sits there, running
        memo=contracts.REPLICA_MEMO.encode(memo),
    )


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Visibility lags starts and ends a little: wait for ``check``."""
    async with asyncio.timeout(30):
        while not await check():
            await asyncio.sleep(0.1)


async def test_a_changed_memo_is_read_and_an_unchanged_listing_keeps_the_list(
    client: Client,
) -> None:
    rid = f"refresh-{uuid.uuid4().hex[:8]}"
    source = TemporalReplicaSource(client, page_size=2)  # several pages, however few
    handle = await _start(client, _memo(rid, ReplicaPhase.PLACING))

    async def phase_is(phase: ReplicaPhase) -> bool:
        return any(m.replica_id == rid and m.phase is phase for m in await source.replicas())

    try:
        await _until(lambda: phase_is(ReplicaPhase.PLACING))

        async def settled() -> bool:  # two listings alike: the same list, no new generation
            first, generation = await source.replicas(), source.generation
            return await source.replicas() is first and source.generation == generation

        await _until(settled)
        # A new run under the same id, its memo different: decoded afresh.
        await handle.terminate("next run")
        handle = await _start(client, _memo(rid, ReplicaPhase.LOADING))
        generation = source.generation
        await _until(lambda: phase_is(ReplicaPhase.LOADING))
        assert source.generation > generation
    finally:
        await handle.terminate("test over")

    async def gone() -> bool:
        return rid not in [m.replica_id for m in await source.replicas()]

    await _until(gone)


async def test_a_malformed_memo_is_skipped_not_a_failed_refresh(client: Client) -> None:
    """Anyone who can start a workflow can write a Replica memo."""
    rid = f"malformed-{uuid.uuid4().hex[:8]}"
    good = await _start(client, _memo(rid, ReplicaPhase.PLACING))
    bad = await client.start_workflow(
        contracts.REPLICA.name,
        id=replica_workflow_id(f"{rid}-bad"),
        task_queue=f"nobody-{rid}",
        memo={contracts.REPLICA_MEMO.key: {"replica_id": f"{rid}-bad", "phase": "no-such-phase"}},
    )
    source = TemporalReplicaSource(client)
    try:

        async def both_listed() -> bool:
            ids = [
                wf.id async for wf in client.list_workflows(f'WorkflowId STARTS_WITH "{good.id}"')
            ]
            return len(ids) == 2

        await _until(both_listed)
        listed = [m.replica_id for m in await source.replicas()]
        assert rid in listed and f"{rid}-bad" not in listed
    finally:
        await good.terminate("test over")
        await bad.terminate("test over")


async def test_the_table_is_rebuilt_only_when_the_source_or_catalog_changed() -> None:
    class Counted:
        """A source that counts its changes, as TemporalReplicaSource does."""

        def __init__(self) -> None:
            self.generation = 0
            self.items = [_memo("a", ReplicaPhase.READY)]
            self.calls = 0

        async def replicas(self) -> list[ReplicaMemo]:
            self.calls += 1
            return self.items

    class Table(RoutingTable):
        updates = 0

        def update(self, replicas: list[ReplicaMemo], catalog: dict[str, ModelSpec]) -> None:
            Table.updates += 1
            super().update(replicas, catalog)

    source, table, ready = Counted(), Table(), asyncio.Event()
    catalog = {"model-a": ModelSpec(name="model-a", source="/m")}
    task = asyncio.create_task(refresh_forever(table, source, lambda: dict(catalog), 0.01, ready))

    async def calls_past(n: int) -> bool:
        return source.calls > n

    try:
        await _until(lambda: calls_past(5))
        assert Table.updates == 1  # five refreshes, nothing changed: built once
        source.generation += 1
        seen = source.calls
        await _until(lambda: calls_past(seen + 2))
        assert Table.updates == 2
        catalog["model-b"] = ModelSpec(name="model-b", source="/m")
        seen = source.calls
        await _until(lambda: calls_past(seen + 2))
        assert Table.updates == 3 and "model-b" in table.known_models
    finally:
        task.cancel()


async def test_a_store_that_does_not_answer_leaves_routing_following_temporal() -> None:
    """The catalog read fails (the store is down): the last catalog serves and
    replicas still come and go with the source's listing."""

    def ready_replica(rid: str) -> ReplicaMemo:
        return ReplicaMemo(
            replica_id=rid, model="model-a", phase=ReplicaPhase.READY, endpoint="http://127.0.0.1:9"
        )

    class Listing:
        def __init__(self) -> None:
            self.items = [ready_replica("a1")]

        async def replicas(self) -> list[ReplicaMemo]:
            return list(self.items)

    store_up = True

    def catalog() -> dict[str, ModelSpec]:
        if not store_up:
            raise OperationalError("SELECT", {}, ConnectionRefusedError("connection refused"))
        return {"model-a": ModelSpec(name="model-a", source="/m", context_length=1234)}

    source, table, ready = Listing(), RoutingTable(), asyncio.Event()
    task = asyncio.create_task(refresh_forever(table, source, catalog, 0.01, ready, 0.5))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        store_up = False
        source.items = [ready_replica("a1"), ready_replica("a2")]

        async def both_routed() -> bool:
            return len(table.candidates("model-a")) == 2

        await _until(both_routed)
        assert table.specs["model-a"].context_length == 1234  # read before the outage
    finally:
        task.cancel()
