"""A replica on one node: validate → fetch weights → launch → wait ready →
watch (through a lost node) → stop its one shard.

The path of ``workflows/replica.py``'s lifecycle for a model whose profile
has one node (``replica_serving.py`` says what the two share). Workflow
code: deterministic; the patches keep stored histories replaying.
"""

from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.types import (
        FetchWeightsResult,
        LaunchShardInput,
        LogTail,
        LogTailInput,
        ModelSpec,
        Placement,
        ProbeEngineResult,
        ReplicaPhase,
        ShardExit,
        ShardHandle,
        ShardRef,
        ShardSpec,
        ValidateInput,
        WaitReadyInput,
        WaitReadyResult,
        WatchShardInput,
    )
    from workflows.calls import failure_reason, fetch_input, node_activity, stop_rank
    from workflows.node_loss import NoAgent, agent_answers, agent_or_silence
    from workflows.replica_serving import WATCH_LIFETIME, ServingEnded, ServingPath
    from workflows.spans import count_fetched

P = ReplicaPhase
I = TypeVar("I")  # noqa: E741 - an activity's input type, as in contracts.Activity[I, R]
R = TypeVar("R")
VALIDATE_PATCH = "validate-before-launch-v1"
FAIL_TAIL_PATCH = "fail-log-tail-v1"
NODE_LOST_PATCH = "node-lost-v1"
LOG_TAIL_LINES = 40


class OneNode(ServingPath):
    """Starts, watches and stops the one shard of a single-node replica."""

    async def serve(self) -> ServingEnded:
        """Start the engine and watch it until it exits."""
        placement = self._placement
        model = self._input.model
        if workflow.patched(VALIDATE_PATCH):
            await contracts.VALIDATE_REPLICA.run(
                ValidateInput(model=model, placement=placement),
                start_to_close_timeout=timedelta(seconds=30),
            )
        if self._fetches:
            fetched: FetchWeightsResult = await self._interruptible(
                self._node_activity(
                    contracts.FETCH_WEIGHTS,
                    fetch_input(self._input.replica_id, model),
                    timedelta(seconds=self._t.fetch_s),
                )
            )
            count_fetched(model.name, fetched.bytes_by_source)
            model = model.model_copy(update={"source": fetched.path})
            how = "from the node's cache" if fetched.cached else "fetched"
            self._move(P.STARTING, f"weights {how}: {fetched.size_bytes} bytes")
        handle = await self._interruptible(self._launch(placement, model))
        self._status.endpoint = handle.endpoint
        self._status.pid = handle.pid
        self._move(P.LOADING, f"pid {handle.pid} on {handle.endpoint}")
        ready: WaitReadyResult = await self._interruptible(
            self._node_activity(
                contracts.WAIT_SHARD_READY,
                WaitReadyInput(shard=self._shard(), timeout_s=self._t.ready_s),
                timedelta(seconds=self._t.ready_s + 30),
            )
        )
        if not model.profile.runtime_lora:
            # Loaded at start, in catalog order (llama.cpp's per-request ids).
            self._status.adapters = [a.name for a in model.adapters]
        self._move(P.READY, f"serving {', '.join(ready.model_ids)}")
        if workflow.patched(NODE_LOST_PATCH):
            exit_info = await self._interruptible(self._watch_through_node_loss())
        else:
            exit_info = await self._interruptible(
                self._node_activity(
                    contracts.WATCH_SHARD,
                    WatchShardInput(shard=self._shard()),
                    WATCH_LIFETIME,
                    retry=RetryPolicy(maximum_interval=timedelta(seconds=10)),
                )
            )
        self._status.log_tail = exit_info.log_tail
        self.launched = False
        return ServingEnded(exit_info.reason, engine_gone=True, node_lost=exit_info.node_lost)

    async def _watch_through_node_loss(self) -> ShardExit:
        """Watch the engine until it exits; a silent agent is not an exit.

        The watch fails when the agent stops heartbeating (frozen, killed,
        partitioned). That is evidence about the agent only, so the replica
        goes ``node-lost`` and stays routable while the control plane probes
        the engine itself; it is back to ``ready`` when an agent answers for
        the same engine, and fails only once the engine has not answered
        for ``engine_unreachable_s`` (DESIGN §8).
        """
        while True:
            try:
                exit_info: ShardExit = await self._node_activity(
                    contracts.WATCH_SHARD,
                    WatchShardInput(shard=self._shard()),
                    WATCH_LIFETIME,
                    retry=RetryPolicy(maximum_attempts=1),
                )
                return exit_info
            except ActivityError as err:
                if isinstance(err.cause, CancelledError):
                    raise  # a stop request cancelled the watch: not a lost node
                lost = failure_reason(err)
            # An agent that restarted (or shut down for an upgrade) answers
            # within seconds: that is no lost node, the watch just resumes.
            node = self._placement.node_id
            try:
                found = await agent_answers(node, self._shard(), self._t)
            except NoAgent:
                self._move(P.NODE_LOST, f"agent on {node} silent ({lost}); probing the engine")
                seen = await agent_or_silence(node, self._shard(), self._status.endpoint, self._t)
                if isinstance(seen, ProbeEngineResult):
                    reason = (
                        f"node {node} lost and engine unreachable for "
                        f"{seen.unanswered_s:.0f}s: {seen.last_error}"
                    )
                    return ShardExit(exit_code=None, reason=reason, node_lost=node)
                found = seen
                if found.pid is not None:
                    adopted = "same pid" if found.pid == self._status.pid else "new pid"
                    self._status.pid = found.pid
                    self._move(P.READY, f"agent on {node} back; engine pid {found.pid} ({adopted})")
            if found.pid is None:
                return found.exit or ShardExit(exit_code=None, reason="engine gone")

    async def _launch(self, placement: Placement, model: ModelSpec) -> ShardHandle:
        spec = ShardSpec(
            replica_id=self._input.replica_id,
            model=model,
            gpu_indices=placement.gpu_indices,
            catalog_digest=self._input.model.digest(),
        )
        self.launched = True
        return await self._node_activity(
            contracts.LAUNCH_SHARD,
            LaunchShardInput(spec=spec),
            timedelta(seconds=self._t.launch_s),
        )

    async def keep_log_tail(self) -> None:
        """On a failure, the engine's last words, kept with it (the node may be gone)."""
        launched_alone = self.launched and not self._status.log_tail
        if not launched_alone or not workflow.patched(FAIL_TAIL_PATCH):
            return
        try:
            tail: LogTail = await self._node_activity(
                contracts.SHARD_LOG_TAIL,
                LogTailInput(shard=self._shard(), lines=LOG_TAIL_LINES),
                timedelta(seconds=30),
                retry=RetryPolicy(maximum_attempts=2),
            )
            self._status.log_tail = tail.lines
        except ActivityError as err:
            workflow.logger.warning("replica %s: no log tail: %s", self._input.replica_id, err)

    async def stop(self) -> None:
        try:
            result = await stop_rank(self._placement.node_id, self._shard(), self._t)
            self.launched = False
            if result.was_running:
                workflow.logger.info(
                    "replica %s engine stopped (exit %s)", self._input.replica_id, result.exit_code
                )
        except ActivityError as err:
            self._status.reason = f"{self._status.reason}; stop failed: {failure_reason(err)}"

    async def _node_activity(
        self,
        activity: contracts.Activity[I, R],
        arg: I,
        start_to_close: timedelta,
        retry: RetryPolicy | None = None,
    ) -> R:
        return await node_activity(
            self._placement.node_id, activity, arg, self._t, start_to_close, retry
        )

    def _shard(self) -> ShardRef:
        return ShardRef(replica_id=self._input.replica_id, rank=0)
