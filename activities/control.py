"""Control activities: the replica workflow's door to the fleet entity.

A workflow cannot send an update to another workflow, so placement goes
through this activity, which does it with a client. The fleet update is
idempotent per replica, so an activity retry cannot double-book a GPU.
"""

from opentelemetry import trace
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities import names
from llmgw.queues import FLEET_WORKFLOW_ID
from llmgw.types import (
    CordonInput,
    FleetSnapshot,
    PlaceRequest,
    PlaceResult,
    ReleaseRequest,
    ReleaseResult,
    ValidateInput,
    ValidateResult,
)
from worker_agent.adapters import launch_problems, node_facts


class ControlActivities:
    """Activities served on the control queue; built with a Temporal client."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn(name=names.PLACE_REPLICA)
    async def place_replica(self, request: PlaceRequest) -> PlaceResult:
        """Ask the fleet to place a replica."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        result: PlaceResult = await handle.execute_update("place", request, result_type=PlaceResult)
        span = trace.get_current_span()
        span.set_attribute("llmgw.replica", request.replica_id)
        span.set_attribute("llmgw.model", request.model.name)
        for rejected in result.rejections:
            span.add_event(
                "node turned down",
                {"llmgw.node": rejected.node_id, "llmgw.reason": rejected.reason},
            )
        if result.preempt:
            span.set_attribute("llmgw.preempting", result.preempt)
        if result.placement:
            span.set_attribute("llmgw.node", result.placement.node_id)
            span.set_attribute("llmgw.gpus", result.placement.gpu_indices)
            activity.logger.info(
                "replica %s placed on %s", request.replica_id, result.placement.node_id
            )
        return result

    @activity.defn(name=names.VALIDATE_REPLICA)
    async def validate_replica(self, request: ValidateInput) -> ValidateResult:
        """Refuse, before anything starts, a launch that would fail slowly,
        hang or run degraded (mixed GPU types in a TP group, fp8 on GPUs that
        cannot run it, parallelism that does not add up...)."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        fleet: FleetSnapshot = await handle.query("snapshot", result_type=FleetSnapshot)
        facts = []
        for shard in request.placement.shards():
            node = fleet.nodes.get(shard.node_id)
            if node is None:
                return ValidateResult(problems=[f"node {shard.node_id} left the fleet"])
            facts.append(node_facts(node, shard.gpu_indices, http_port=0))
        problems = launch_problems(request.model, request.model.profile, facts, request.rendezvous)
        if problems:
            raise ApplicationError(
                "cannot start: " + "; ".join(problems),
                type="LaunchValidationError",
                non_retryable=True,
            )
        return ValidateResult()

    @activity.defn(name=names.FLEET_CORDON)
    async def fleet_cordon(self, request: CordonInput) -> FleetSnapshot:
        """Cordon or uncordon a node (an empty node id only reads the fleet)."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        if not request.node_id:
            snap: FleetSnapshot = await handle.query("snapshot", result_type=FleetSnapshot)
            return snap
        result: FleetSnapshot = await handle.execute_update(
            "cordon", request, result_type=FleetSnapshot
        )
        return result

    @activity.defn(name=names.RELEASE_REPLICA)
    async def release_replica(self, request: ReleaseRequest) -> ReleaseResult:
        """Give a replica's allocation back to the fleet."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        result: ReleaseResult = await handle.execute_update(
            "release", request, result_type=ReleaseResult
        )
        return result
