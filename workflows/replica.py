"""One replica's lifecycle: place → launch → wait ready → serve/watch → stop.

This module is the lifecycle both kinds of replica share (placing,
preempting, stopping, draining, failing, releasing, publishing); how a
replica starts and is watched is its serving path, on one node
(``workflows/replica_one_node.py``) or as ranks on several
(``workflows/replica_ranks.py``).

Workflow id ``replica/<replica_id>``. Every phase is published as memo and
search attributes (the router and the Temporal UI read them) and the full
state answers the ``status`` query. Activities for the engine run on the
node's own task queue; if the control plane dies mid-start the history
resumes exactly where it was, and the agent's launch is idempotent, so a
retried launch finds the engine instead of starting a second.
"""

import asyncio
import contextlib
from collections.abc import Awaitable
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw import search_attributes as sa
    from llmgw.errors import LlmgwError
    from llmgw.queues import replica_workflow_id
    from llmgw.types import (
        AdaptersChanged,
        DrainInput,
        Placement,
        PlaceRequest,
        ReleaseRequest,
        ReplicaInput,
        ReplicaPhase,
        ReplicaReadyNotice,
        ReplicaStatus,
        ShardRef,
        StopReplicaInput,
    )
    from workflows.calls import failure_reason, node_activity
    from workflows.replica_one_node import OneNode
    from workflows.replica_ranks import Ranks
    from workflows.replica_serving import ServingPath
    from workflows.replica_state import is_terminal, memo_of, note, transition
    from workflows.spans import decision

P = ReplicaPhase
T = TypeVar("T")
FETCH_WEIGHTS_PATCH = "fetch-weights-v1"
DRAIN_PATCH = "drain-wait-v1"
NOTIFY_PARENT_PATCH = "notify-parent-ready-v1"
NOTIFY_PARENT_END_PATCH = "notify-parent-ended-v1"


class _StopRequested(LlmgwError):
    """Internal: a stop update arrived while waiting for something else."""


@workflow.defn(name=contracts.REPLICA.name)
class ReplicaWorkflow:
    """The lifecycle of one replica."""

    @workflow.init
    def __init__(self, input: ReplicaInput) -> None:
        self._input = input
        self._t = input.timeouts
        self._status = ReplicaStatus(
            replica_id=input.replica_id, model=input.model.name, phase=P.PLACING
        )
        self._stop: StopReplicaInput | None = None
        self._placement: Placement | None = None
        self._fetches = False
        # How the replica serves, once placed.
        self._path: ServingPath | None = None
        self._notify: asyncio.Future[None] | None = None

    @workflow.run
    async def run(self, input: ReplicaInput) -> ReplicaStatus:
        """Drive the replica to a terminal phase and return its final state."""
        self._publish()
        try:
            await self._start_and_serve()
        except _StopRequested:
            await self._stop_engine()
        except (ActivityError, ChildWorkflowError) as err:
            await self._fail(failure_reason(err))
        except asyncio.CancelledError:
            # Cancelled from the UI/CLI: still give the GPU and process back.
            await self._stop_engine()
            await self._tell_parent_ended()
            raise
        if self._notify is not None:
            # The deployment may be gone already; a lost notice changes nothing.
            with contextlib.suppress(Exception):
                await self._notify
        await self._tell_parent_ended()
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._status

    async def _tell_parent_ended(self) -> None:
        """Tell the deployment, whichever of its runs is current, that this replica ended.

        A deployment that continued as new never sees its earlier children's
        results; this signal is how it learns.
        """
        parent = workflow.info().parent
        if parent is None or not workflow.patched(NOTIFY_PARENT_END_PATCH):
            return
        handle = workflow.get_external_workflow_handle(parent.workflow_id)
        with contextlib.suppress(Exception):  # a deployment already gone needs no notice
            await contracts.REPLICA_ENDED.send(handle, self._status)

    @workflow.update(name=contracts.STOP.name)
    async def stop(self, request: StopReplicaInput) -> ReplicaStatus:
        """Stop the replica (draining first) and answer once it has stopped."""
        if self._stop is None:
            self._stop = request
        await workflow.wait_condition(lambda: is_terminal(self._status.phase))
        return self._status

    @workflow.signal(name=contracts.REQUEST_STOP.name)
    def request_stop(self, request: StopReplicaInput) -> None:
        """Stop the replica (workflows, which cannot send updates, signal)."""
        if self._stop is None:
            self._stop = request
            self._status.preempted_by = request.preempted_by

    @workflow.signal(name=contracts.ADAPTERS_CHANGED.name)
    def adapters_changed(self, change: AdaptersChanged) -> None:
        """An AdapterLoad changed what the engine holds: recorded and published."""
        held = [a for a in self._status.adapters if a not in change.unloaded]
        held += [a for a in change.loaded if a not in held]
        self._status.adapters = held
        note(self._status, workflow.now().isoformat(), change.reason)
        workflow.logger.info("replica %s: %s", self._input.replica_id, change.reason)
        self._publish()

    @workflow.query(name=contracts.REPLICA_STATUS.name)
    def status(self) -> ReplicaStatus:
        """The replica's full state."""
        return self._status

    async def _start_and_serve(self) -> None:
        placement = await self._place()
        if placement is None:
            return
        serving = Ranks if self._input.model.profile.nodes > 1 else OneNode
        self._path = serving(
            self._input,
            self._status,
            placement,
            self._move,
            self._interruptible,
            fetches=self._fetches,
        )
        ended = await self._path.serve()
        await self._fail(ended.reason, engine_gone=ended.engine_gone, node_lost=ended.node_lost)

    async def _place(self) -> Placement | None:
        attempt = 0
        while attempt < self._t.place_attempts:
            result = await contracts.PLACE_REPLICA.run(
                PlaceRequest(replica_id=self._input.replica_id, model=self._input.model),
                start_to_close_timeout=timedelta(seconds=30),
            )
            if result.preempt:
                # Room is reserved: waiting for the victims to drain is not a
                # failed attempt (a drain can outlast every placement retry).
                await self._preempt(result.preempt)
            else:
                attempt += 1
            if result.placement is not None:
                self._placement = result.placement
                self._status.node_id = result.placement.node_id
                # Histories from before the fetch step replay without it.
                self._fetches = workflow.patched(FETCH_WEIGHTS_PATCH)
                first = P.FETCHING if self._fetches else P.STARTING
                self._move(first, f"placed on {result.placement.node_id}")
                return result.placement
            reasons = "; ".join(f"{r.node_id}: {r.reason}" for r in result.rejections)
            self._status.reason = f"cannot place: {reasons}"
            workflow.logger.warning(
                "replica %s attempt %d: %s", self._input.replica_id, attempt, reasons
            )
            if await self._stop_within(self._t.place_retry_s):
                if self._status.preempting:
                    await self._release()  # gives back the room reserved for it
                self._move(P.STOPPED, "stopped before placement")
                return None
        if self._status.preempting:
            await self._release()
        self._move(P.FAILED, self._status.reason)
        return None

    async def _preempt(self, victims: list[str]) -> None:
        """Ask lower-priority replicas to drain; recorded on both sides."""
        model = self._input.model
        for victim in victims:
            if victim in self._status.preempting:
                continue
            self._status.preempting.append(victim)
            self._move(P.PLACING, f"preempting {victim} (priority {model.priority} wins)")
            request = StopReplicaInput(
                reason=f"preempted by {self._input.replica_id} "
                f"({model.name}, priority {model.priority})",
                preempted_by=self._input.replica_id,
            )
            try:
                await contracts.REQUEST_STOP.send(
                    workflow.get_external_workflow_handle(replica_workflow_id(victim)), request
                )
            except Exception as err:  # a victim that already ended needs no signal
                workflow.logger.info(
                    "replica %s: victim %s: %s", self._input.replica_id, victim, err
                )

    async def _interruptible(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless a stop request arrives first."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(workflow.wait_condition(lambda: self._stop is not None))
        await workflow.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            stop.cancel()
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ActivityError):
            await task
        raise _StopRequested

    async def _stop_within(self, seconds: float) -> bool:
        try:
            await workflow.wait_condition(
                lambda: self._stop is not None, timeout=timedelta(seconds=seconds)
            )
        except TimeoutError:
            return False
        return True

    async def _stop_engine(self) -> None:
        reason = self._stop.reason if self._stop else "cancelled"
        self._status.reason = reason
        lost = self._status.phase is P.NODE_LOST
        if self._status.phase in (P.STARTING, P.LOADING, P.READY, P.NODE_LOST) and (
            self._stop is None or self._stop.drain
        ):
            # Published first, so routers stop sending before the engine goes.
            self._move(P.DRAINING, reason)
            if lost:
                # No agent to ask whether requests are in flight: the routers'
                # grace is all the drain there is.
                await workflow.sleep(timedelta(seconds=self._t.router_grace_s))
            elif workflow.patched(DRAIN_PATCH):
                await self._drain()
        if not is_terminal(self._status.phase):
            self._move(P.STOPPING, reason)
        await self._stop_shard()
        await self._release()
        if not is_terminal(self._status.phase):
            self._move(P.STOPPED, reason)

    async def _drain(self) -> None:
        """Let routers notice, then let in-flight requests finish (bounded)."""
        if self._placement is None or not self._launched():
            return
        await workflow.sleep(timedelta(seconds=self._t.router_grace_s))
        leader = ShardRef(replica_id=self._input.replica_id, rank=0)
        try:
            drained = await node_activity(
                self._placement.node_id,
                contracts.DRAIN_SHARD,
                DrainInput(shard=leader, timeout_s=self._t.drain_s),
                self._t,
                timedelta(seconds=self._t.drain_s + 30),
            )
            workflow.logger.info(
                "replica %s drained in %.1fs (%s)",
                self._input.replica_id,
                drained.waited_s,
                drained.detail,
            )
        except ActivityError as err:
            # Draining is a courtesy: it must never keep a replica from stopping.
            workflow.logger.warning("replica %s drain failed: %s", self._input.replica_id, err)

    async def _fail(self, reason: str, *, engine_gone: bool = False, node_lost: str = "") -> None:
        self._status.reason = reason
        if self._path is not None:
            await self._path.keep_log_tail()
        if not engine_gone:
            # Never leak a process (or its GPU) because the start went wrong.
            await self._stop_shard()
        await self._release(node_lost)
        if not is_terminal(self._status.phase):
            self._move(P.FAILED, reason)

    async def _stop_shard(self) -> None:
        if self._path is None or not self._path.launched or self._placement is None:
            return
        await self._path.stop()

    def _launched(self) -> bool:
        """Whether an engine (or a rank) may be running."""
        return self._path is not None and self._path.launched

    async def _release(self, node_lost: str = "") -> None:
        if self._placement is None:
            return
        await contracts.RELEASE_REPLICA.run(
            ReleaseRequest(replica_id=self._input.replica_id, node_lost=node_lost),
            start_to_close_timeout=timedelta(seconds=30),
        )
        self._placement = None

    def _move(self, phase: ReplicaPhase, detail: str = "") -> None:
        transition(self._status, phase, workflow.now().isoformat(), detail)
        workflow.logger.info("replica %s -> %s %s", self._input.replica_id, phase, detail)
        decision(f"replica.{phase.value}", replica=self._input.replica_id, detail=detail)
        self._publish()
        parent = workflow.info().parent
        if phase is P.READY and parent is not None and workflow.patched(NOTIFY_PARENT_PATCH):
            # A deployment in a rolling restart retires the old replica only
            # once this one serves.
            self._notify = asyncio.ensure_future(
                contracts.REPLICA_READY.send(
                    workflow.get_external_workflow_handle(parent.workflow_id),
                    ReplicaReadyNotice(
                        replica_id=self._input.replica_id, node_id=self._status.node_id
                    ),
                )
            )

    def _publish(self) -> None:
        s = self._status
        memo = memo_of(s).model_copy(update={"engine": self._input.model.engine.value})
        workflow.upsert_memo(contracts.REPLICA_MEMO.encode(memo))
        # No patch: replay checks an upsert's command type, not its
        # attributes (the stored histories replay with ReplicaUpdatedAt added).
        workflow.upsert_search_attributes(
            [
                sa.REPLICA_MODEL.value_set(s.model),
                sa.REPLICA_NODE.value_set(s.node_id or "-"),
                sa.REPLICA_STATE.value_set(s.phase.value),
                sa.REPLICA_ENDPOINT.value_set(s.endpoint or "-"),
                # The router's delta listing finds the replicas changed since by it.
                sa.REPLICA_UPDATED_AT.value_set(workflow.now()),
            ]
        )
