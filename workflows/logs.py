"""ShardLogs: fetch a shard's log tail from its node, for ``llmgw logs``.

A short workflow rather than an update on the replica, so reading logs adds
nothing to the replica's history and works for replicas that already ended.
"""

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.queues import node_queue
    from llmgw.types import LogTail, LogTailInput, ShardLogsInput


@workflow.defn(name=contracts.SHARD_LOGS.name)
class ShardLogsWorkflow:
    """Runs one node activity and returns its answer."""

    @workflow.run
    async def run(self, request: ShardLogsInput) -> LogTail:
        """The tail of one shard's engine log."""
        return await contracts.SHARD_LOG_TAIL.run(
            LogTailInput(shard=request.shard, lines=request.lines),
            task_queue=node_queue(request.node_id),
            schedule_to_start_timeout=timedelta(seconds=10),
            start_to_close_timeout=timedelta(seconds=10),
        )
