"""A replica on several nodes: a Rendezvous child starts the ranks, every
rank is watched, the first to exit fails the whole replica, a stop stops
every rank.

The path of ``workflows/replica.py``'s lifecycle for a model whose profile
has more than one node (``replica_serving.py`` says what the two share).
Workflow code: deterministic.
"""

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.types import (
        RendezvousInput,
        RendezvousResult,
        ReplicaPhase,
        ShardExit,
        ShardRef,
        WatchShardInput,
    )
    from workflows.calls import failure_reason, node_activity, stop_rank
    from workflows.replica_serving import WATCH_LIFETIME, ServingEnded, ServingPath

P = ReplicaPhase


class Ranks(ServingPath):
    """Starts (through a Rendezvous), watches and stops the ranks of a multi-node replica."""

    async def serve(self) -> ServingEnded:
        """Start every rank, then watch them until the first exits."""
        placement = self._placement
        rid = self._input.replica_id
        ranks = placement.shards()
        self.launched = True
        if self._status.phase is P.FETCHING:
            self._move(P.STARTING, f"rendezvous of {len(ranks)} ranks")
        started: RendezvousResult = await self._interruptible(
            contracts.RENDEZVOUS.execute_child(
                RendezvousInput(
                    replica_id=rid, model=self._input.model, placement=placement, timeouts=self._t
                ),
                id=f"rendezvous/{rid}",
            )
        )
        self._status.endpoint = started.leader.endpoint
        self._status.pid = started.leader.pid
        self._move(P.LOADING, f"{len(started.ranks)} ranks up; leader pid {started.leader.pid}")
        self._move(P.READY, f"serving {self._input.model.name} from {started.leader.endpoint}")
        rank, exit_info = await self._interruptible(self._first_exit())
        self._status.log_tail = exit_info.log_tail
        return ServingEnded(f"rank {rank}: {exit_info.reason}")

    async def _first_exit(self) -> tuple[int, ShardExit]:
        watches = {
            asyncio.ensure_future(
                node_activity(
                    shard.node_id,
                    contracts.WATCH_SHARD,
                    WatchShardInput(
                        shard=ShardRef(replica_id=self._input.replica_id, rank=shard.rank)
                    ),
                    self._t,
                    WATCH_LIFETIME,
                    retry=RetryPolicy(maximum_interval=timedelta(seconds=10)),
                )
            ): shard.rank
            for shard in self._placement.shards()
        }
        try:
            done, _ = await workflow.wait(list(watches), return_when=asyncio.FIRST_COMPLETED)
            first = next(iter(done))
            return watches[first], first.result()
        finally:
            for task in watches:
                task.cancel()

    async def stop(self) -> None:
        # The placement's ranks, as serve started them (stop runs only once it has).
        for shard in self._placement.shards():
            ref = ShardRef(replica_id=self._input.replica_id, rank=shard.rank)
            try:
                await stop_rank(shard.node_id, ref, self._t)
            except ActivityError as err:
                self._status.reason += f"; stop of rank {shard.rank} failed: {failure_reason(err)}"
        self.launched = False
