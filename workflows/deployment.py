"""Deployment: one workflow per model (id ``deployment/<model>``) that keeps
the desired number of replicas running.

Each replica is a child Replica workflow; a replica that ends is replaced
after an exponential backoff, and a slot whose replicas keep failing is
reaped (left failed, with the last reason and log tail) instead of feeding a
restart storm. Scaling down drains the newest replicas; cancelling the
deployment drains them all.

A deployment lives as long as its model is served, so it continues as new
when its history grows long. Its replicas keep running across that (they
are started with the ABANDON parent-close policy) and report their end by
signal to whichever run is current.
"""

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ChildWorkflowError
from temporalio.workflow import ChildWorkflowHandle, ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities import names
    from llmgw import search_attributes as sa
    from llmgw.queues import replica_workflow_id
    from llmgw.types import (
        DeploymentCarry,
        DeploymentInput,
        DeploymentStatus,
        ReplicaInput,
        ReplicaPhase,
        ReplicaReadyNotice,
        ReplicaStatus,
        RollingRestartInput,
        ScaleInput,
        SetModelInput,
        ShardLoad,
        ShardRef,
        Slot,
        StopReplicaInput,
    )
    from workflows.calls import node_activity
    from workflows.deployment_rules import backoff_s, should_reap, slots_to_retire
    from workflows.spans import decision

Outcome = tuple[int, ReplicaStatus | None, str]
JOB_SEARCH_ATTRIBUTES_PATCH = "job-search-attributes-v1"
LEAST_LOADED_PATCH = "scale-down-least-loaded-v1"
REAPED_HOLDS_PATCH = "reaped-slot-holds-its-place-v1"


@workflow.defn(name="Deployment")
class DeploymentWorkflow:
    """Reconciles desired replicas of one model against those running."""

    @workflow.init
    def __init__(self, input: DeploymentInput) -> None:
        carry = input.carry or DeploymentCarry(desired=input.replicas, slots=[], next_slot=0)
        self._input = input.model_copy(update={"carry": None})
        self._desired = carry.desired
        self._slots: list[Slot] = carry.slots
        # Replicas this run started: their end arrives as a child result.
        self._running: dict[int, asyncio.Future[Outcome]] = {}
        self._handles: dict[int, ChildWorkflowHandle[object, ReplicaStatus]] = {}
        # Replicas an earlier run started: their end arrives as a signal.
        self._inherited: set[int] = set(carry.live)
        self._ended: dict[str, ReplicaStatus] = {}
        self._retiring: set[int] = set(carry.retiring)
        self._changed = False
        self._next_slot = carry.next_slot
        self._rolling: list[int] = carry.rolling
        self._published = ""
        self._reaped_hold = False

    @workflow.run
    async def run(self, input: DeploymentInput) -> DeploymentStatus:
        """Reconcile until scaled to zero with nothing left running."""
        # Runs from before the fix replaced a reaped slot with a new one.
        self._reaped_hold = workflow.patched(REAPED_HOLDS_PATCH)
        try:
            while True:
                await self._reconcile()
                self._publish()
                if self._desired == 0 and not self._active():
                    break
                if self._history_long():
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    workflow.continue_as_new(self._carry())
                await self._wait_for_change()
                self._collect()
        except asyncio.CancelledError:
            # Replicas outlive their deployment's run (so that continue-as-new
            # keeps them): on cancel, drain them all before ending.
            self._desired = 0
            while self._active():
                await self._reconcile()
                await self._wait_for_change()
                self._collect()
            raise
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.status()

    @workflow.signal(name="replica_ended")
    def replica_ended(self, final: ReplicaStatus) -> None:
        """A replica ended (sent by replicas, whichever run started them)."""
        self._ended[final.replica_id] = final
        self._changed = True

    def _publish(self) -> None:
        """Model and state as search attributes: the Temporal UI lists jobs by them."""
        live = self._live()
        if self._rolling or any(s.replaces is not None for s in self._slots):
            state = "rolling"
        elif any(s.reaped for s in live):
            state = "degraded"
        elif len(live) == self._desired and all(s.ready for s in live):
            state = "steady"
        else:
            state = "scaling" if self._desired else "removing"
        if state == self._published or not workflow.patched(JOB_SEARCH_ATTRIBUTES_PATCH):
            return
        self._published = state
        workflow.upsert_search_attributes(
            [sa.REPLICA_MODEL.value_set(self._input.model.name), sa.REPLICA_STATE.value_set(state)]
        )

    def _active(self, number: int | None = None) -> bool:
        """Whether slot ``number`` (any slot, when None) has a replica running."""
        if number is None:
            return bool(self._running or self._inherited)
        return number in self._running or number in self._inherited

    def _history_long(self) -> bool:
        info = workflow.info()
        limit = self._input.continue_after_events
        return info.is_continue_as_new_suggested() or (
            limit > 0 and info.get_current_history_length() >= limit
        )

    def _carry(self) -> DeploymentInput:
        workflow.logger.info(
            "deployment %s continues as new with %d slots", self._input.model.name, len(self._slots)
        )
        carry = DeploymentCarry(
            desired=self._desired,
            slots=self._slots,
            next_slot=self._next_slot,
            rolling=self._rolling,
            retiring=sorted(self._retiring),
            live=sorted({*self._running, *self._inherited}),
        )
        return self._input.model_copy(update={"carry": carry})

    @workflow.update(name="scale")
    def scale(self, request: ScaleInput) -> DeploymentStatus:
        """Set the desired number of replicas."""
        self._desired = request.replicas
        self._changed = True
        return self.status()

    @workflow.update(name="set_model")
    def set_model(self, request: SetModelInput) -> DeploymentStatus:
        """Start new replicas from ``request.model`` and roll the running ones onto it."""
        self._input = self._input.model_copy(update={"model": request.model})
        self._begin_roll(request.reason)
        return self.status()

    @workflow.update(name="rolling_restart")
    def rolling_restart(self, request: RollingRestartInput) -> DeploymentStatus:
        """Replace every replica one at a time: start new, wait ready, drain old."""
        self._begin_roll(request.reason)
        return self.status()

    def _begin_roll(self, reason: str) -> None:
        for slot in self._slots:
            if slot.reaped:  # a restart (or a new model) is a new chance
                slot.reaped = False
                slot.consecutive_failures = 0
                slot.next_start_at = ""
        if not self._rolling:
            self._rolling = [s.slot for s in self._live() if s.replaces is None]
            workflow.logger.info(
                "deployment %s: %s of %d slots", self._input.model.name, reason, len(self._rolling)
            )
        self._changed = True

    @workflow.signal(name="replica_ready")
    def replica_ready(self, notice: ReplicaReadyNotice) -> None:
        """A child replica serves: a rolling restart may retire what it replaces."""
        for slot in self._slots:
            if slot.replica_id == notice.replica_id:
                slot.ready = True
                slot.node_id = notice.node_id
        self._changed = True

    @workflow.query(name="status")
    def status(self) -> DeploymentStatus:
        """Every slot: its current replica, restarts, and why the last one ended."""
        return DeploymentStatus(
            model=self._input.model.name,
            desired=self._desired,
            slots=self._slots,
            rolling=self._rolling,
            model_digest=self._input.model.digest(),
        )

    def _live(self) -> list[Slot]:
        """Slots that count towards the desired number (not leaving or surging).

        A reaped slot keeps its place: replacing it with a new slot would
        restart the crash loop it was reaped for. A scale-down removes it
        first; a rolling restart (or a changed model) gives it a new chance.
        """
        return [
            s
            for s in self._slots
            if (self._reaped_hold or not s.reaped)
            and s.slot not in self._retiring
            and s.replaces is None
        ]

    async def _reconcile(self) -> None:
        while len(self._live()) < self._desired:
            self._slots.append(Slot(slot=self._next_slot))
            self._next_slot += 1
        live = self._live()
        if len(live) > self._desired:
            loads = await self._loads(live) if workflow.patched(LEAST_LOADED_PATCH) else {}
            for slot in slots_to_retire(live, self._desired, loads):
                await self._retire(slot)
        await self._roll()
        now = workflow.now()
        for slot in self._slots:
            due = not slot.next_start_at or datetime.fromisoformat(slot.next_start_at) <= now
            if not slot.reaped and not self._active(slot.slot) and due:
                await self._start(slot)

    async def _loads(self, slots: list[Slot]) -> dict[int, float | None]:
        """Requests in flight on each serving replica, asked of its node's agent."""
        quick = self._input.timeouts.model_copy(update={"schedule_to_start_s": 5.0})
        asks = {
            s.slot: asyncio.ensure_future(
                node_activity(
                    s.node_id,
                    names.SHARD_LOAD,
                    ShardRef(replica_id=s.replica_id),
                    ShardLoad,
                    quick,
                    timedelta(seconds=10),
                    retry=RetryPolicy(maximum_attempts=1),
                )
            )
            for s in slots
            if s.ready and s.node_id and self._active(s.slot)
        }
        loads: dict[int, float | None] = {}
        for number, ask in asks.items():
            try:
                loads[number] = (await ask).in_flight
            except ActivityError:
                loads[number] = None  # unknown counts as busy
        workflow.logger.info("deployment %s loads by slot: %s", self._input.model.name, loads)
        return loads

    async def _roll(self) -> None:
        """One step of a rolling restart: at most one surge replica at a time."""
        surge = next((s for s in self._slots if s.replaces is not None), None)
        if surge is not None:
            if surge.ready:
                old = next((s for s in self._slots if s.slot == surge.replaces), None)
                surge.replaces = None  # it counts as a regular slot from now on
                if old is not None:
                    await self._retire(old)
            return
        while self._rolling:
            number = self._rolling.pop(0)
            if any(s.slot == number and not s.reaped for s in self._slots):
                self._slots.append(Slot(slot=self._next_slot, replaces=number))
                self._next_slot += 1
                return

    async def _start(self, slot: Slot) -> None:
        name = self._input.model.name
        slot.replica_id = f"{name}-{str(workflow.uuid4())[:8]}"
        slot.starts += 1
        slot.next_start_at = ""
        slot.ready = False
        handle = await workflow.start_child_workflow(
            "Replica",
            ReplicaInput(
                replica_id=slot.replica_id, model=self._input.model, timeouts=self._input.timeouts
            ),
            id=replica_workflow_id(slot.replica_id),
            result_type=ReplicaStatus,
            # Replicas outlive a run of their deployment: continue-as-new must
            # not stop them. A cancelled deployment drains them itself; one
            # terminated leaves them to the reconcile pass (parent gone).
            parent_close_policy=ParentClosePolicy.ABANDON,
        )
        self._handles[slot.slot] = handle
        self._running[slot.slot] = asyncio.ensure_future(_outcome(slot.slot, handle))
        decision("deployment.start", model=name, slot=slot.slot, replica=slot.replica_id)
        workflow.logger.info("deployment %s slot %d: replica %s", name, slot.slot, slot.replica_id)

    async def _retire(self, slot: Slot) -> None:
        if slot.slot in self._retiring:
            return
        self._retiring.add(slot.slot)
        decision("deployment.retire", model=self._input.model.name, slot=slot.slot,
                 replica=slot.replica_id)  # fmt: skip
        handle = self._handles.get(slot.slot)
        stop = StopReplicaInput(reason="scaled down")
        if handle is not None and slot.slot in self._running:
            await handle.signal("request_stop", stop)
        elif slot.slot in self._inherited:
            external = workflow.get_external_workflow_handle(replica_workflow_id(slot.replica_id))
            await external.signal("request_stop", stop)
        else:
            self._slots.remove(slot)

    async def _wait_for_change(self) -> None:
        self._changed = False
        waits: list[asyncio.Future[object]] = [
            asyncio.ensure_future(workflow.wait_condition(lambda: self._changed)),
            *self._running.values(),  # type: ignore[list-item]
        ]
        due = [datetime.fromisoformat(s.next_start_at) for s in self._slots if s.next_start_at]
        if due:
            delay = max(0.0, (min(due) - workflow.now()).total_seconds())
            waits.append(asyncio.ensure_future(asyncio.sleep(delay)))
        await workflow.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for fut in waits:
            if fut not in self._running.values():
                fut.cancel()

    def _collect(self) -> None:
        for number, fut in list(self._running.items()):
            if not fut.done():
                continue
            del self._running[number]
            self._handles.pop(number, None)
            _, final, error = fut.result()
            self._slot_ended(number, final, error)
        for number in sorted(self._inherited):
            slot = next(s for s in self._slots if s.slot == number)
            final = self._ended.pop(slot.replica_id, None)
            if final is not None:
                self._inherited.discard(number)
                self._slot_ended(number, final, "")
        # The rest are notices from this run's own children, already counted
        # (or about to be) through their results.
        self._ended.clear()

    def _slot_ended(self, number: int, final: ReplicaStatus | None, error: str) -> None:
        slot = next(s for s in self._slots if s.slot == number)
        if number in self._retiring:
            self._retiring.discard(number)
            self._slots.remove(slot)
            return
        self._record_end(slot, final, error)

    def _record_end(self, slot: Slot, final: ReplicaStatus | None, error: str) -> None:
        slot.last_reason = error or (final.reason if final else "") or "ended"
        slot.last_log_tail = final.log_tail if final else []
        policy = self._input.restart
        if final is not None and final.preempted_by:
            # Made room for a more important model: not a failure of ours.
            # The replacement waits in placement until room frees up.
            slot.preempted_by = final.preempted_by
            decision("deployment.preempted", model=self._input.model.name, slot=slot.slot,
                     replica=slot.replica_id, by=final.preempted_by)  # fmt: skip
            slot.next_start_at = (
                workflow.now() + timedelta(seconds=policy.initial_backoff_s)
            ).isoformat()
            workflow.logger.warning(
                "deployment %s slot %d: %s", self._input.model.name, slot.slot, slot.last_reason
            )
            return
        served = final is not None and any(h.phase is ReplicaPhase.READY for h in final.history)
        if served:
            slot.consecutive_failures = 0  # it worked for a while: not a crash loop
        slot.consecutive_failures += 1
        if should_reap(slot, policy):
            slot.reaped = True
            decision("deployment.reap", model=self._input.model.name, slot=slot.slot,
                     replica=slot.replica_id, reason=slot.last_reason)  # fmt: skip
            workflow.logger.warning(
                "deployment %s slot %d reaped after %d failures: %s",
                self._input.model.name,
                slot.slot,
                slot.consecutive_failures,
                slot.last_reason,
            )
            return
        delay = backoff_s(slot.consecutive_failures, policy)
        decision("deployment.restart_scheduled", model=self._input.model.name, slot=slot.slot,
                 after_s=delay, reason=slot.last_reason)  # fmt: skip
        slot.next_start_at = (workflow.now() + timedelta(seconds=delay)).isoformat()


async def _outcome(number: int, handle: ChildWorkflowHandle[object, ReplicaStatus]) -> Outcome:
    try:
        return number, await handle, ""
    except ChildWorkflowError as err:
        return number, None, str(err.cause or err)
