"""DrainNode: the job that empties a node for maintenance.

Cordon first, so nothing new lands there; then ask every replica on the node
to drain and stop. A replica owned by a deployment is replaced by it, and
placement (which skips cordoned nodes) puts the replacement elsewhere.
Uncordon with the fleet's ``cordon`` update (``cordoned: false``).
"""

import asyncio
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw import search_attributes as sa
    from llmgw.queues import replica_workflow_id
    from llmgw.types import (
        CordonInput,
        DrainNodeInput,
        DrainNodeResult,
        FleetSnapshot,
        StopReplicaInput,
    )


JOB_SEARCH_ATTRIBUTES_PATCH = "job-search-attributes-v1"


def on_node(fleet: FleetSnapshot, node_id: str) -> list[str]:
    """Replicas with any rank on ``node_id``."""
    return sorted(
        rid
        for rid, placement in fleet.allocations.items()
        if any(s.node_id == node_id for s in placement.shards())
    )


@workflow.defn(name=contracts.DRAIN_NODE.name)
class DrainNodeWorkflow:
    """Cordon a node and drain its replicas, bounded."""

    @workflow.run
    async def run(self, request: DrainNodeInput) -> DrainNodeResult:
        """Wait until no replica holds the node, or the deadline passes."""
        publish = workflow.patched(JOB_SEARCH_ATTRIBUTES_PATCH)
        if publish:
            workflow.upsert_search_attributes(
                [sa.REPLICA_NODE.value_set(request.node_id), sa.REPLICA_STATE.value_set("draining")]
            )
        fleet = await self._fleet(CordonInput(node_id=request.node_id))
        asked = on_node(fleet, request.node_id)
        workflow.logger.info("node %s cordoned; draining %s", request.node_id, asked)
        for rid in asked:
            handle = workflow.get_external_workflow_handle(replica_workflow_id(rid))
            await contracts.REQUEST_STOP.send(
                handle, StopReplicaInput(reason=f"node {request.node_id} drained")
            )
        deadline = workflow.now() + timedelta(seconds=request.timeout_s)
        remaining = asked
        while remaining and workflow.now() < deadline:
            await asyncio.sleep(request.poll_s)
            remaining = [r for r in on_node(await self._fleet(None), request.node_id) if r in asked]
        if publish:
            state = "drained" if not remaining else "timed out"
            workflow.upsert_search_attributes([sa.REPLICA_STATE.value_set(state)])
        return DrainNodeResult(
            node_id=request.node_id,
            drained=[r for r in asked if r not in remaining],
            remaining=remaining,
        )

    async def _fleet(self, cordon: CordonInput | None) -> FleetSnapshot:
        return await contracts.FLEET_CORDON.run(
            cordon or CordonInput(node_id="", cordoned=False),
            start_to_close_timeout=timedelta(seconds=30),
        )
