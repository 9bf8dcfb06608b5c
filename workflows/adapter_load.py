"""AdapterLoad: bring one catalog adapter into one replica's engine.

Workflow id ``adapter/<replica>/<adapter>``, started with the USE_EXISTING
conflict policy: concurrent requests for the same cold adapter attach to one
load (single flight). A failed load fails this run only; the next request
starts a new one, so neither the replica nor the adapter is poisoned. When
the replica is full, the router names the least recently used idle adapter
to unload first; the replica's history records both.
"""

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.queues import replica_workflow_id
    from llmgw.types import (
        AdapterCall,
        AdapterCallResult,
        AdapterLoadInput,
        AdapterLoadResult,
        AdaptersChanged,
        ReplicaTimeouts,
    )
    from workflows.calls import node_activity
    from workflows.spans import decision

# A load is quick (vLLM: milliseconds) once the node takes the task.
TIMEOUTS = ReplicaTimeouts(schedule_to_start_s=15.0, heartbeat_s=60.0)


@workflow.defn(name=contracts.ADAPTER_LOAD.name)
class AdapterLoadWorkflow:
    """Unload an idle adapter if asked, load the wanted one, tell the replica."""

    @workflow.run
    async def run(self, request: AdapterLoadInput) -> AdapterLoadResult:
        """Load ``request.adapter`` into ``request.replica_id``'s engine."""
        rid, name = request.replica_id, request.adapter.name
        evicted = None
        if request.evict:
            await node_activity(
                request.node_id, contracts.UNLOAD_ADAPTER,
                AdapterCall(replica_id=rid, name=request.evict),
                TIMEOUTS, timedelta(seconds=60),
            )  # fmt: skip
            evicted = request.evict
            decision(
                "adapter.unload", replica=rid, adapter=request.evict, reason="LRU, to make room"
            )
        call = AdapterCall(
            replica_id=rid, name=name, path=request.adapter.source, max_loaded=request.max_loaded
        )
        result: AdapterCallResult = await node_activity(
            request.node_id, contracts.LOAD_ADAPTER, call,
            TIMEOUTS, timedelta(seconds=120), retry=RetryPolicy(maximum_attempts=3),
        )  # fmt: skip
        decision("adapter.load", replica=rid, adapter=name, changed=result.changed)
        reason = f"loaded {name}" + (
            f", unloaded {evicted} (least recently used, idle)" if evicted else ""
        )
        # The engine was full after all (the router's view lagged): the node
        # unloaded an idle adapter itself.
        made_room = [u for u in result.unloaded if u != evicted]
        if made_room:
            reason += f", unloaded {', '.join(made_room)} (engine full, idle)"
            evicted = evicted or made_room[0]
        try:
            await contracts.ADAPTERS_CHANGED.send(
                workflow.get_external_workflow_handle(replica_workflow_id(rid)),
                AdaptersChanged(
                    loaded=[name],
                    unloaded=[*([request.evict] if request.evict else []), *made_room],
                    reason=reason,
                ),
            )
        except Exception as err:  # a replica that ended meanwhile needs no notice
            workflow.logger.info("adapter %s: replica %s not told: %s", name, rid, err)
        return AdapterLoadResult(
            replica_id=rid,
            adapter=name,
            loaded=result.changed,
            evicted=evicted,
            detail=result.detail,
        )
