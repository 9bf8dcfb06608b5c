"""ModelPull: a model's pinned weights fetched to nodes ahead of a deploy.

Each node runs the same ``fetch_weights`` activity a replica start does, on
its own queue, all at once; its heartbeats (``FetchProgressDetail``) are the
job's progress, told apart by activity id (``pull_activity_id``). A pull
holds nothing: the entries it leaves may be evicted under the cache budget
until a replica uses them. A node that fails is reported, the others go on.
"""

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.queues import node_queue
    from llmgw.types import FetchWeightsResult
    from llmgw.types.pull import ModelPullInput, ModelPullResult, NodePull, pull_activity_id
    from workflows.calls import failure_reason, fetch_input


@workflow.defn(name=contracts.MODEL_PULL.name)
class ModelPullWorkflow:
    """Fetch one model's weights on each node asked, in parallel."""

    @workflow.run
    async def run(self, request: ModelPullInput) -> ModelPullResult:
        """Every node's outcome; the job itself fails only on bad input."""
        workflow.logger.info("pulling %s to %s", request.model.name, request.nodes)
        outcomes = await asyncio.gather(*(self._pull(request, n) for n in request.nodes))
        return ModelPullResult(model=request.model.name, nodes=list(outcomes))

    async def _pull(self, request: ModelPullInput, node_id: str) -> NodePull:
        t = request.timeouts
        arg = fetch_input(f"pull-{workflow.info().workflow_id}", request.model)
        try:
            fetched: FetchWeightsResult = await contracts.FETCH_WEIGHTS.run(
                arg.model_copy(update={"hold": False}),
                task_queue=node_queue(node_id),
                activity_id=pull_activity_id(node_id),
                schedule_to_start_timeout=timedelta(seconds=t.schedule_to_start_s),
                start_to_close_timeout=timedelta(seconds=t.fetch_s),
                heartbeat_timeout=timedelta(seconds=t.heartbeat_s),
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError as err:
            workflow.logger.warning("pull of %s to %s failed", request.model.name, node_id)
            return NodePull(node_id=node_id, ok=False, reason=failure_reason(err))
        return NodePull(
            node_id=node_id, ok=True, size_bytes=fetched.size_bytes, cached=fetched.cached
        )
