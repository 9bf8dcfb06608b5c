"""The routing table's delta refresh (issue 17): between full listings only
the Replica workflows changed since the last listing are read.

Real dev server, a module's own (so that no other test's replicas, started
without ``ReplicaUpdatedAt``, turn the deltas off), and a stand-in Replica
workflow that publishes as the real one does: memo plus ``ReplicaUpdatedAt``.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError
from temporalio.worker import Worker

from llmgw import contracts
from llmgw import search_attributes as sa
from llmgw.queues import FLEET_WORKFLOW_ID, replica_workflow_id
from llmgw.temporal import connect
from llmgw.types import ReplicaMemo, ReplicaPhase
from router.control_link.replica_source import (
    DELTA_MARGIN_S,
    TemporalReplicaSource,
    delta_query,
    delta_since,
    rfc3339,
)
from router.control_link.routing import RoutingTable, refresh_forever
from tests.harness import devserver

QUEUE = "stand-in-replicas"
PUBLISH = "publish"
HOUR = 3600.0  # no resync due within a test: every refresh after the first may be a delta


@workflow.defn(name=contracts.REPLICA.name, sandboxed=False)
class PublishingReplica:
    """Publishes its memo as the Replica workflow does, at start and on each signal."""

    @workflow.run
    async def run(self, memo: ReplicaMemo) -> None:
        """Publish, then sit until terminated."""
        self.publish(memo)
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name=PUBLISH)
    def publish(self, memo: ReplicaMemo) -> None:
        """What ``ReplicaWorkflow._publish`` writes that the router reads."""
        workflow.upsert_memo(contracts.REPLICA_MEMO.encode(memo))
        workflow.upsert_search_attributes([sa.REPLICA_UPDATED_AT.value_set(workflow.now())])


@pytest.fixture(scope="module")
def own_temporal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with devserver(tmp_path_factory.mktemp("temporal-delta")) as address:
        yield address


@pytest.fixture(scope="module")
async def own_client(own_temporal: str) -> AsyncIterator[Client]:
    client = await connect(own_temporal)
    async with Worker(client, task_queue=QUEUE, workflows=[PublishingReplica]):
        yield client


def _memo(rid: str, phase: ReplicaPhase = ReplicaPhase.READY) -> ReplicaMemo:
    # No endpoint: kept whatever nodes the Fleet registered (nothing is sent to it).
    return ReplicaMemo(replica_id=rid, model=f"model-{rid}", phase=phase)


async def _start(
    client: Client, phase: ReplicaPhase = ReplicaPhase.READY
) -> WorkflowHandle[object, object]:
    rid = f"delta-{uuid.uuid4().hex[:8]}"
    return await client.start_workflow(
        contracts.REPLICA.name, _memo(rid, phase), id=replica_workflow_id(rid), task_queue=QUEUE
    )


def _rid(handle: WorkflowHandle[object, object]) -> str:
    return handle.id.split("/", 1)[1]


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Visibility lags starts, publishes and ends a little: wait for ``check``."""
    async with asyncio.timeout(30):
        while not await check():
            await asyncio.sleep(0.1)


def _phase(
    source: TemporalReplicaSource, rid: str, phase: ReplicaPhase | None
) -> Callable[[], Awaitable[bool]]:
    """A check: one refresh, after which ``rid`` is in the list in ``phase``
    (None: not in the list)."""

    async def check() -> bool:
        found = [m.phase for m in await source.replicas() if m.replica_id == rid]
        return found == ([] if phase is None else [phase])

    return check


async def _in_delta_mode(source: TemporalReplicaSource) -> None:
    async def delta() -> bool:
        await source.replicas()
        return source.last_since is not None

    await _until(delta)


async def _ready_in_delta(
    client: Client, source: TemporalReplicaSource
) -> tuple[WorkflowHandle[object, object], str]:
    """A replica started and seen ready, the source refreshing by deltas
    (the replica is terminated if that never comes)."""
    handle = await _start(client)
    rid = _rid(handle)
    try:
        await _until(_phase(source, rid, ReplicaPhase.READY))
        await _in_delta_mode(source)
    except BaseException:
        await handle.terminate("setup failed")
        raise
    return handle, rid


def test_a_delta_follows_a_full_listing_until_a_resync_is_due() -> None:
    # No full listing yet, or the last listing failed: a full one.
    assert delta_since(100.0, None, None, 300.0, legacy=False) is None
    assert delta_since(100.0, 50.0, None, 300.0, legacy=False) is None
    # Between full listings: from the previous listing's start, less the margin.
    assert delta_since(100.0, 50.0, 99.0, 300.0, legacy=False) == 99.0 - DELTA_MARGIN_S
    assert delta_since(100.0, 50.0, 99.0, 300.0, legacy=False, margin_s=5.0) == 94.0
    # The bound moves forward with each listing.
    assert delta_since(101.0, 50.0, 100.0, 300.0, legacy=False) == 100.0 - DELTA_MARGIN_S
    # A resync is due: a full listing.
    assert delta_since(350.0, 50.0, 349.0, 300.0, legacy=False) is None
    # A running replica without ReplicaUpdatedAt: full listings every time.
    assert delta_since(100.0, 50.0, 99.0, 300.0, legacy=True) is None


def test_the_delta_query_is_rfc3339_utc_over_all_statuses() -> None:
    assert rfc3339(0.25) == "1970-01-01T00:00:00.250000Z"
    query = delta_query(1_800_000_000.0)
    t = "2027-01-15T08:00:00.000000Z"
    assert query == (
        f'WorkflowType="Replica" AND (ReplicaUpdatedAt >= "{t}"'
        f' OR StartTime >= "{t}" OR CloseTime >= "{t}")'
    )
    assert "ExecutionStatus" not in query  # closed ones are listed: they leave the table


async def test_a_phase_change_is_seen_by_a_delta_and_the_bound_moves_forward(
    own_client: Client,
) -> None:
    source = TemporalReplicaSource(own_client, full_resync_s=HOUR)
    handle, rid = await _ready_in_delta(own_client, source)
    try:
        first = source.last_since
        await source.replicas()
        assert first is not None and source.last_since is not None
        assert source.last_since > first
        generation = source.generation
        await handle.signal(PUBLISH, _memo(rid, ReplicaPhase.DRAINING))
        await _until(_phase(source, rid, ReplicaPhase.DRAINING))
        assert source.last_since is not None  # seen by a delta
        assert source.generation > generation
    finally:
        await handle.terminate("test over")


async def test_a_terminated_replica_leaves_the_table_at_the_next_delta(
    own_client: Client,
) -> None:
    """Terminated, it never publishes again: its close is what a delta sees."""
    source = TemporalReplicaSource(own_client, full_resync_s=HOUR)
    handle, rid = await _ready_in_delta(own_client, source)
    await handle.terminate("gone")
    await _until(_phase(source, rid, None))
    assert source.last_since is not None


async def test_a_replica_without_the_attribute_forces_full_listings(
    own_client: Client,
) -> None:
    """Started by an older llmgw: its phase changes would not show in a delta."""
    source = TemporalReplicaSource(own_client, full_resync_s=HOUR)
    new = await _start(own_client)
    old_rid = f"old-{uuid.uuid4().hex[:8]}"
    old = await own_client.start_workflow(
        contracts.REPLICA.name,
        id=replica_workflow_id(old_rid),
        task_queue=f"nobody-{old_rid}",  # no worker: it never sets ReplicaUpdatedAt
        memo=contracts.REPLICA_MEMO.encode(_memo(old_rid)),
    )
    try:
        await _until(_phase(source, old_rid, ReplicaPhase.READY))
        await _until(_phase(source, _rid(new), ReplicaPhase.READY))
        for _ in range(3):
            await source.replicas()
            assert source.last_since is None
    finally:
        await old.terminate("test over")
    # Gone from a full listing: deltas again.
    await _in_delta_mode(source)
    await new.terminate("test over")


async def test_a_failed_delta_keeps_the_table_and_the_next_listing_is_full(
    own_client: Client,
) -> None:
    bad = False
    bad_queries = 0

    def query(since: float) -> str:
        nonlocal bad_queries
        if not bad:
            return delta_query(since)
        bad_queries += 1
        return 'WorkflowType="Replica" AND ReplicaUpdatedAt >= "not a time"'

    source = TemporalReplicaSource(own_client, full_resync_s=HOUR, make_delta_query=query)
    handle, rid = await _ready_in_delta(own_client, source)
    try:
        bad = True
        generation = source.generation
        with pytest.raises(RPCError):
            await source.replicas()
        # The delta query still fails: this one succeeds only as a full listing.
        assert rid in [m.replica_id for m in await source.replicas()]
        assert source.last_since is None and source.generation == generation

        # The router's refresh loop keeps its table through failed deltas.
        bad = False
        table, ready = RoutingTable(), asyncio.Event()
        task = asyncio.create_task(refresh_forever(table, source, dict, 0.05, ready))
        try:

            async def delta_mode() -> bool:
                return ready.is_set() and source.last_since is not None

            await _until(delta_mode)
            bad, bad_queries = True, 0

            async def failed_twice() -> bool:  # a delta, a full listing, a delta
                return bad_queries >= 2

            await _until(failed_twice)
            assert rid in [m.replica_id for m in table.replicas] and not task.done()
        finally:
            task.cancel()
    finally:
        await handle.terminate("test over")


async def test_newly_registered_nodes_are_checked_against_every_entry_in_a_delta(
    own_client: Client,
) -> None:
    """The delta lists nothing new, yet the Fleet's nodes changed: the replica
    on the newly registered node is routed from that refresh on."""
    source = TemporalReplicaSource(own_client, full_resync_s=HOUR)
    rid = f"delta-{uuid.uuid4().hex[:8]}"
    memo = ReplicaMemo(
        replica_id=rid, model="m", phase=ReplicaPhase.READY, node_id="n1",
        endpoint="http://10.9.9.9:18000",
    )  # fmt: skip
    handle = await own_client.start_workflow(
        contracts.REPLICA.name, memo, id=replica_workflow_id(rid), task_queue=QUEUE
    )
    fleet: WorkflowHandle[object, object] | None = None
    try:

        async def published() -> bool:
            query = f'WorkflowId="{handle.id}" AND ReplicaUpdatedAt >= "{rfc3339(0)}"'
            return (await own_client.count_workflows(query)).count == 1

        await _until(published)
        await _in_delta_mode(source)  # it is listed by now, but on no registered node
        assert rid not in [m.replica_id for m in await source.replicas()]
        fleet = await own_client.start_workflow(
            contracts.FLEET.name,
            id=FLEET_WORKFLOW_ID,
            task_queue="nobody-fleet",
            memo=contracts.FLEET_NODES_MEMO.encode(contracts.FleetNodes({"n1": "10.9.9.9"})),
        )
        assert rid in [m.replica_id for m in await source.replicas()]
        assert source.last_since is not None
    finally:
        await handle.terminate("test over")
        if fleet is not None:
            await fleet.terminate("test over")
