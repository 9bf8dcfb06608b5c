"""How a replica tells a silent agent from a dead engine (DESIGN §8).

The replica workflow keeps its phases; these calls only gather the
evidence: whether the node's agent answers for the engine, and, while it
does not, whether the engine itself still answers a probe from the control
plane. Called from workflow code, so deterministic.
"""

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.errors import LlmgwError
    from llmgw.types import (
        ProbeEngineInput,
        ProbeEngineResult,
        ReplicaTimeouts,
        ShardRef,
        ShardRunning,
    )
    from workflows.calls import failure_reason, node_activity

# How long a failed watch waits for an agent before the node counts as lost.
AGENT_QUICK = timedelta(seconds=5)
# While its node is lost, a replica waits this long for the agent per
# attempt (then asks again): the wait costs nothing, the history grows by a
# few events per attempt.
AGENT_WAIT = timedelta(hours=1)
# The probe lives as long as the node stays lost; its heartbeats bound it.
PROBE_LIFETIME = timedelta(days=3650)


class NoAgent(LlmgwError):
    """No agent answered for the node in time."""


async def agent_answers(node: str, shard: ShardRef, timeouts: ReplicaTimeouts) -> ShardRunning:
    """What the node's agent finds of ``shard`` within AGENT_QUICK; NoAgent if none answers."""
    quick = timeouts.model_copy(update={"schedule_to_start_s": AGENT_QUICK.total_seconds()})
    try:
        return await node_activity(
            node,
            contracts.SHARD_RUNNING,
            shard,
            quick,
            timedelta(seconds=30),
            retry=RetryPolicy(maximum_attempts=1),
        )
    except ActivityError as err:
        if isinstance(err.cause, CancelledError):
            raise
        raise NoAgent(failure_reason(err)) from err


async def agent_or_silence(
    node: str, shard: ShardRef, endpoint: str, timeouts: ReplicaTimeouts
) -> ShardRunning | ProbeEngineResult:
    """Whichever comes first: an agent answering for ``shard``, or the engine
    at ``endpoint`` not answering for ``engine_unreachable_s``."""
    patient = timeouts.model_copy(update={"schedule_to_start_s": AGENT_WAIT.total_seconds()})

    def ask_agent() -> asyncio.Future[ShardRunning]:
        return asyncio.ensure_future(
            node_activity(
                node,
                contracts.SHARD_RUNNING,
                shard,
                patient,
                timedelta(seconds=30),
                retry=RetryPolicy(maximum_interval=timedelta(seconds=10)),
            )
        )

    agent = ask_agent()
    probe: asyncio.Future[ProbeEngineResult] = asyncio.ensure_future(
        contracts.PROBE_ENGINE.run(
            ProbeEngineInput(
                replica_id=shard.replica_id,
                endpoint=endpoint,
                interval_s=timeouts.probe_interval_s,
                unreachable_s=timeouts.engine_unreachable_s,
            ),
            start_to_close_timeout=PROBE_LIFETIME,
            heartbeat_timeout=timedelta(seconds=max(30.0, 3 * timeouts.probe_interval_s)),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
        )
    )
    try:
        while True:
            pending: list[asyncio.Future[Any]] = [agent, probe]
            await workflow.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if probe.done():
                return probe.result()
            try:
                return agent.result()
            except ActivityError as err:
                # The agent did not come back within AGENT_WAIT: ask again.
                workflow.logger.info("replica %s: still no agent: %s", shard.replica_id, err)
                agent = ask_agent()
    finally:
        agent.cancel()
        probe.cancel()
