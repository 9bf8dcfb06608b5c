"""How workflows call node activities: one place for timeouts and retries.

Every call to a node's queue has a schedule-to-start timeout, so a dead node
is noticed in seconds instead of hanging a start, and a heartbeat timeout,
so a dead agent is noticed during long work.
"""

from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.queues import node_queue
    from llmgw.types import (
        FetchWeightsInput,
        ModelSpec,
        ReplicaTimeouts,
        ShardRef,
        StopShardInput,
        StopShardResult,
    )

I = TypeVar("I")  # noqa: E741 - an activity's input type, as in contracts.Activity[I, R]
R = TypeVar("R")


async def node_activity(
    node_id: str,
    activity: contracts.Activity[I, R],
    arg: I,
    timeouts: ReplicaTimeouts,
    start_to_close: timedelta,
    retry: RetryPolicy | None = None,
) -> R:
    """Run ``activity`` on ``node_id``'s queue."""
    return await activity.run(
        arg,
        task_queue=node_queue(node_id),
        schedule_to_start_timeout=timedelta(seconds=timeouts.schedule_to_start_s),
        start_to_close_timeout=start_to_close,
        heartbeat_timeout=timedelta(seconds=timeouts.heartbeat_s),
        retry_policy=retry or RetryPolicy(maximum_attempts=3),
    )


async def stop_rank(node_id: str, shard: ShardRef, timeouts: ReplicaTimeouts) -> StopShardResult:
    """Stop one rank's process group (a no-op when it is not running)."""
    return await node_activity(
        node_id,
        contracts.STOP_SHARD,
        StopShardInput(shard=shard, grace_s=timeouts.stop_grace_s),
        timeouts,
        timedelta(seconds=timeouts.stop_grace_s + 30),
        retry=RetryPolicy(maximum_attempts=5),
    )


def fetch_input(replica_id: str, model: ModelSpec) -> FetchWeightsInput:
    """What a node is asked to fetch for ``model`` (and the engine it installs)."""
    return FetchWeightsInput(
        replica_id=replica_id,
        source=model.source,
        sha256=model.sha256,
        engine=model.engine,
        device=model.profile.device,
        pin=model.pin,
        storage_profile=model.storage_profile,
        model=model.name,
    )


def failure_reason(err: BaseException) -> str:
    """The most specific message in a failure chain (activity or child)."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, ApplicationError):
            return f"{cause.type or 'error'}: {cause.message}"
        cause = cause.__cause__
    return str(err)
