"""ModelPull: a model's pinned weights fetched to nodes ahead of a deploy.

Each node runs the same ``fetch_weights`` activity a replica start does, on
its own queue, all at once; its heartbeats (``FetchProgressDetail``) are the
job's progress, told apart by activity id (``pull_activity_id``). The
nodes form a tree (``pull_tree``): the first fetches from the origin, each
other asks its parent, then the parent's parent, before the origin, so the
origin serves the artifact about once however many nodes pull. A pull
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


# Children per node in a pull's tree: each node's peer server serves this many.
PULL_FANOUT = 2
# Ancestors a node asks before the origin.
PULL_PEERS = 3


def pull_tree(nodes: list[str]) -> dict[str, list[str]]:
    """Each node's peers in a pull, nearest first (pure: tested alone): node i's
    parent is node (i - 1) // PULL_FANOUT, in the order asked."""
    peers: dict[str, list[str]] = {}
    for i, node in enumerate(nodes):
        chain: list[str] = []
        at = i
        while at > 0 and len(chain) < PULL_PEERS:
            at = (at - 1) // PULL_FANOUT
            chain.append(nodes[at])
        peers[node] = chain
    return peers


@workflow.defn(name=contracts.MODEL_PULL.name)
class ModelPullWorkflow:
    """Fetch one model's weights on each node asked, in parallel."""

    @workflow.run
    async def run(self, request: ModelPullInput) -> ModelPullResult:
        """Every node's outcome; the job itself fails only on bad input."""
        workflow.logger.info("pulling %s to %s", request.model.name, request.nodes)
        tree = pull_tree(request.nodes)
        outcomes = await asyncio.gather(*(self._pull(request, n, tree[n]) for n in request.nodes))
        return ModelPullResult(model=request.model.name, nodes=list(outcomes))

    async def _pull(self, request: ModelPullInput, node_id: str, peers: list[str]) -> NodePull:
        t = request.timeouts
        arg = fetch_input(f"pull-{workflow.info().workflow_id}", request.model)
        try:
            fetched: FetchWeightsResult = await contracts.FETCH_WEIGHTS.run(
                arg.model_copy(update={"hold": False, "peer_nodes": peers}),
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
