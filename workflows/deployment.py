"""Deployment: one workflow per model (id ``deployment/<model>``) that keeps
the desired number of replicas running.

Each replica is a child Replica workflow; a replica that ends is replaced
after an exponential backoff, and a slot whose replicas keep failing is
reaped (left failed, with the last reason and log tail) instead of feeding a
restart storm. Scaling down drains the least loaded replicas; cancelling
the deployment drains them all.

With an autoscale policy the desired count follows the load the routers
report (signal ``report_load``; workflows/autoscale.py decides), a durable
timer wakes it for the idle timeout and the down window, and every change
is recorded with its reason. Such a deployment stays running at zero
replicas and is woken by a router holding requests (update ``wake``). An
explicit ``scale`` is a fixed count again; ``set_autoscale`` switches.

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
    from llmgw import contracts
    from llmgw import search_attributes as sa
    from llmgw.queues import replica_workflow_id
    from llmgw.types import (
        DeploymentCarry,
        DeploymentInput,
        DeploymentStatus,
        ElasticState,
        LoadReport,
        ReplicaInput,
        ReplicaReadyNotice,
        ReplicaStatus,
        RollingRestartInput,
        ScaleInput,
        SetAutoscaleInput,
        SetModelInput,
        ShardRef,
        Slot,
        StopReplicaInput,
        WakeInput,
        WakeResult,
    )
    from workflows.calls import node_activity
    from workflows.deployment_load import DueTimer, LoadBook, wake_outcome
    from workflows.deployment_rules import backoff_s, slots_to_retire
    from workflows.deployment_slots import SlotBook, SlotEnd
    from workflows.spans import count_scale, decision

ReplicaOutcome = tuple[int, ReplicaStatus | None, str]
JOB_SEARCH_ATTRIBUTES_PATCH = "job-search-attributes-v1"
LEAST_LOADED_PATCH = "scale-down-least-loaded-v1"
REAPED_HOLDS_PATCH = "reaped-slot-holds-its-place-v1"
CONVERGE_PATCH = "converge-after-roll-v1"
ELASTIC_PATCH = "elastic-serving-v1"


@workflow.defn(name=contracts.DEPLOYMENT.name)
class DeploymentWorkflow:
    """Reconciles desired replicas of one model against those running."""

    @workflow.init
    def __init__(self, input: DeploymentInput) -> None:
        carry = input.carry or DeploymentCarry(desired=input.replicas, slots=[], next_slot=0)
        self._input = input.model_copy(update={"carry": None})
        self._book = SlotBook(
            desired=carry.desired,
            slots=carry.slots,
            next_slot=carry.next_slot,
            rolling=carry.rolling,
            retiring=set(carry.retiring),
            active=set(carry.live),
            reaped_hold=False,
            converge=False,
        )
        # Replicas this run started: their end arrives as a child result.
        self._running: dict[int, asyncio.Future[ReplicaOutcome]] = {}
        self._handles: dict[int, ChildWorkflowHandle[object, ReplicaStatus]] = {}
        # Replicas an earlier run started: their end arrives as a signal.
        self._inherited: set[int] = set(carry.live)
        self._ended: dict[str, ReplicaStatus] = {}
        self._changed = False
        self._published = ""
        # A first run takes the policy from its model; later runs from the carry.
        elastic = carry.elastic if input.carry else ElasticState(policy=input.model.autoscale)
        self._load = LoadBook(elastic or ElasticState())
        self._elastic_patched = False
        self._timer = DueTimer()
        # Replica ends that were not asked for, and the last one's reason: a
        # wake waiting for a replica fails on the next one.
        self._ends = 0
        self._last_end = ""
        self._wakes = 0

    @workflow.run
    async def run(self, input: DeploymentInput) -> DeploymentStatus:
        """Reconcile until scaled to zero with nothing left running."""
        # Runs from before the fix replaced a reaped slot with a new one.
        self._book.reaped_hold = workflow.patched(REAPED_HOLDS_PATCH)
        # Runs from before the fix could keep the surplus of a finished roll.
        self._book.converge = workflow.patched(CONVERGE_PATCH)
        try:
            while True:
                self._autoscale()
                await self._reconcile()
                self._publish()
                if self._book.desired == 0 and not self._active() and not self._elastic():
                    break
                # A waiting wake would be cut off by continue-as-new, and it
                # waits on this loop (starts, ends): carry on until it answered.
                if self._history_long() and not self._wakes:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    workflow.continue_as_new(self._carry())
                await self._wait_for_change()
                self._collect()
        except asyncio.CancelledError:
            # Replicas outlive their deployment's run (so that continue-as-new
            # keeps them): on cancel, drain them all before ending.
            self._book.desired = 0
            while self._active():
                await self._reconcile()
                await self._wait_for_change()
                self._collect()
            raise
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.status()

    @workflow.signal(name=contracts.REPLICA_ENDED.name)
    def replica_ended(self, final: ReplicaStatus) -> None:
        """A replica ended (sent by replicas, whichever run started them)."""
        self._ended[final.replica_id] = final
        self._changed = True

    def _publish(self) -> None:
        """Model and state as search attributes: the Temporal UI lists jobs by them."""
        book = self._book
        live = book.live()
        if book.rolling or any(s.replaces is not None for s in book.slots):
            state = "rolling"
        elif any(s.reaped for s in live):
            state = "degraded"
        elif len(live) == book.desired and all(s.ready for s in live):
            state = "steady" if book.desired or not self._elastic() else "idle"
        else:
            state = "scaling" if book.desired else "removing"
        if state == self._published or not workflow.patched(JOB_SEARCH_ATTRIBUTES_PATCH):
            return
        self._published = state
        workflow.upsert_search_attributes(
            [sa.REPLICA_MODEL.value_set(self._input.model.name), sa.REPLICA_STATE.value_set(state)]
        )

    def _active(self, number: int | None = None) -> bool:
        """Whether slot ``number`` (any slot, when None) has a replica running."""
        if number is None:
            return bool(self._book.active)
        return number in self._book.active

    def _history_long(self) -> bool:
        info = workflow.info()
        limit = self._input.continue_after_events
        return info.is_continue_as_new_suggested() or (
            limit > 0 and info.get_current_history_length() >= limit
        )

    def _carry(self) -> DeploymentInput:
        book = self._book
        workflow.logger.info(
            "deployment %s continues as new with %d slots", self._input.model.name, len(book.slots)
        )
        carry = DeploymentCarry(
            desired=book.desired,
            slots=book.slots,
            next_slot=book.next_slot,
            rolling=book.rolling,
            retiring=sorted(book.retiring),
            live=sorted(book.active),
            elastic=self._load.state,
        )
        return self._input.model_copy(update={"carry": carry})

    @workflow.update(name=contracts.SCALE.name)
    def scale(self, request: ScaleInput) -> DeploymentStatus:
        """Set the desired number of replicas: a fixed count (autoscaling stops)."""
        self._load.set_policy(None, workflow.now().timestamp())
        self._book.desired = request.replicas
        self._changed = True
        return self.status()

    @workflow.update(name=contracts.SET_AUTOSCALE.name)
    def set_autoscale(self, request: SetAutoscaleInput) -> DeploymentStatus:
        """Follow the load within ``request.policy`` (None: keep today's count, fixed)."""
        self._load.set_policy(request.policy, workflow.now().timestamp())
        self._changed = True
        return self.status()

    @workflow.signal(name=contracts.REPORT_LOAD.name)
    def report_load(self, report: LoadReport) -> None:
        """A router's load on this model (about once a second while it has any)."""
        self._load.report(report, workflow.now().timestamp())
        if self._load.policy is not None:
            self._changed = True

    @workflow.update(name=contracts.WAKE.name)
    async def wake(self, request: WakeInput) -> WakeResult:
        """Requests wait for this model: start a replica if at zero, and answer
        once one serves or the start failed. Idempotent: however many routers
        ask, one replica starts."""
        policy = self._load.policy
        now = workflow.now().timestamp()
        if policy is not None:
            self._load.touch(now)  # a request: the idle timeout starts again
        if self._book.desired == 0:
            if policy is None:
                name = self._input.model.name
                reason = f"{name} is scaled to 0 replicas (a fixed count; `llmgw scale {name}`)"
                return WakeResult(ready=False, reason=reason)
            by = f" (router {request.router_id})" if request.router_id else ""
            self._set_desired(max(1, policy.min_replicas), f"wake: {request.reason}{by}")
        ends = self._ends
        self._wakes += 1
        try:
            await workflow.wait_condition(lambda: self._woken(ends) is not None)
        finally:
            self._wakes -= 1
        ready, reason = self._woken(ends) or (False, "")
        return WakeResult(ready=ready, reason=reason, desired=self._book.desired)

    def _woken(self, ends: int) -> tuple[bool, str] | None:
        failed = self._last_end if self._ends > ends else ""
        return wake_outcome(self._book, self._input.model.name, failed)

    def _elastic(self) -> bool:
        """Whether the count follows the load (histories from before replay as they ran)."""
        if self._load.policy is None:
            return False
        if not self._elastic_patched:
            self._elastic_patched = workflow.patched(ELASTIC_PATCH)
        return self._elastic_patched

    def _autoscale(self) -> None:
        """Set the desired count the load calls for, if it differs."""
        if not self._elastic():
            return
        now = workflow.now().timestamp()
        choice = self._load.evaluate(self._book.desired, now, self._starting())
        if choice is not None:
            self._set_desired(choice.desired, choice.reason)

    def _starting(self) -> bool:
        book = self._book
        return any(s.slot in book.active and not s.ready for s in book.live())

    def _set_desired(self, count: int, reason: str) -> None:
        before = self._book.desired
        made = self._load.record(before, count, reason, workflow.now().timestamp())
        self._book.desired = count
        self._changed = True
        name = self._input.model.name
        decision("deployment.autoscale", model=name, before=before, after=count, reason=reason)
        count_scale(name, before, count)
        workflow.logger.info("deployment %s: %s", name, made.reason)

    def _autoscale_timer(self) -> "asyncio.Future[None] | None":
        """The durable timer for the next autoscale check (None: no autoscale)."""
        if not self._elastic():
            return None
        now = workflow.now().timestamp()
        return self._timer.arm(
            self._load.next_check(self._book.desired, now, self._starting()), now
        )

    @workflow.update(name=contracts.SET_MODEL.name)
    def set_model(self, request: SetModelInput) -> DeploymentStatus:
        """Start new replicas from ``request.model`` and roll the running ones onto it."""
        self._input = self._input.model_copy(update={"model": request.model})
        self._begin_roll(request.reason)
        return self.status()

    @workflow.update(name=contracts.ROLLING_RESTART.name)
    def rolling_restart(self, request: RollingRestartInput) -> DeploymentStatus:
        """Replace every replica one at a time: start new, wait ready, drain old."""
        self._begin_roll(request.reason)
        return self.status()

    def _begin_roll(self, reason: str) -> None:
        rolling = bool(self._book.rolling)
        self._book.begin_roll()
        if not rolling:
            workflow.logger.info(
                "deployment %s: %s of %d slots",
                self._input.model.name,
                reason,
                len(self._book.rolling),
            )
        self._changed = True

    @workflow.signal(name=contracts.REPLICA_READY.name)
    def replica_ready(self, notice: ReplicaReadyNotice) -> None:
        """A child replica serves: a rolling restart may retire what it replaces."""
        self._book.ready(notice.replica_id, notice.node_id)
        if self._load.policy is not None:
            # A replica's idle timeout runs from when it can serve, not from
            # before its (maybe long) load.
            self._load.touch(workflow.now().timestamp())
        self._changed = True

    @workflow.query(name=contracts.DEPLOYMENT_STATUS.name)
    def status(self) -> DeploymentStatus:
        """Every slot: its current replica, restarts, and why the last one ended."""
        return DeploymentStatus(
            model=self._input.model.name,
            desired=self._book.desired,
            slots=self._book.slots,
            rolling=self._book.rolling,
            model_digest=self._input.model.digest(),
            autoscale=self._load.policy,
            decisions=self._load.state.decisions,
            load=self._load.summary(workflow.now().timestamp()),
        )

    async def _reconcile(self) -> None:
        book = self._book
        book.grow()
        await self._scale_down()
        await self._roll()
        if book.converge:
            # A roll that just ended counts its surge slot as live: drain the
            # surplus now rather than at some later change.
            await self._scale_down()
        now = workflow.now()
        for slot in book.due(now):
            await self._start(slot)

    async def _scale_down(self) -> None:
        live = self._book.surplus()
        if not live:
            return
        loads = await self._loads(live) if workflow.patched(LEAST_LOADED_PATCH) else {}
        for slot in slots_to_retire(live, self._book.desired, loads):
            await self._retire(slot)

    async def _loads(self, slots: list[Slot]) -> dict[int, float | None]:
        """Requests in flight on each serving replica, asked of its node's agent."""
        quick = self._input.timeouts.model_copy(update={"schedule_to_start_s": 5.0})
        asks = {
            s.slot: asyncio.ensure_future(
                node_activity(
                    s.node_id,
                    contracts.SHARD_LOAD,
                    ShardRef(replica_id=s.replica_id),
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
        old = self._book.roll_step()
        if old is not None:
            await self._retire(old)

    async def _start(self, slot: Slot) -> None:
        name = self._input.model.name
        self._book.started(slot, f"{name}-{str(workflow.uuid4())[:8]}")
        handle = await contracts.REPLICA.start_child(
            ReplicaInput(
                replica_id=slot.replica_id, model=self._input.model, timeouts=self._input.timeouts
            ),
            id=replica_workflow_id(slot.replica_id),
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
        if slot.slot in self._book.retiring:
            return
        decision("deployment.retire", model=self._input.model.name, slot=slot.slot,
                 replica=slot.replica_id)  # fmt: skip
        if not self._book.retire(slot):
            return
        handle = self._handles.get(slot.slot)
        stop = StopReplicaInput(reason="scaled down")
        if handle is not None and slot.slot in self._running:
            await contracts.REQUEST_STOP.send(handle, stop)
        elif slot.slot in self._inherited:
            external = workflow.get_external_workflow_handle(replica_workflow_id(slot.replica_id))
            await contracts.REQUEST_STOP.send(external, stop)

    async def _wait_for_change(self) -> None:
        self._changed = False
        waits: list[asyncio.Future[object]] = [
            asyncio.ensure_future(workflow.wait_condition(lambda: self._changed)),
            *self._running.values(),  # type: ignore[list-item]
        ]
        timer = self._autoscale_timer()
        if timer is not None:
            waits.append(timer)  # type: ignore[arg-type]
        due = [datetime.fromisoformat(s.next_start_at) for s in self._book.slots if s.next_start_at]
        if due:
            delay = max(0.0, (min(due) - workflow.now()).total_seconds())
            waits.append(asyncio.ensure_future(asyncio.sleep(delay)))
        await workflow.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for fut in waits:
            # The autoscale timer stays armed across waits (each new timer is
            # two more events in the history).
            if fut not in self._running.values() and fut is not self._timer.future:
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
            slot = self._book.slot(number)
            final = self._ended.pop(slot.replica_id, None)
            if final is not None:
                self._inherited.discard(number)
                self._slot_ended(number, final, "")
        # The rest are notices from this run's own children, already counted
        # (or about to be) through their results.
        self._ended.clear()

    def _slot_ended(self, number: int, final: ReplicaStatus | None, error: str) -> None:
        policy = self._input.restart
        slot, what = self._book.ended(number, final, error, workflow.now(), policy)
        model = self._input.model.name
        if what is SlotEnd.RETIRED:
            return
        self._ends += 1
        self._last_end = f"replica {slot.replica_id} ended: {slot.last_reason}"
        if what is SlotEnd.PREEMPTED:
            decision("deployment.preempted", model=model, slot=slot.slot,
                     replica=slot.replica_id, by=slot.preempted_by)  # fmt: skip
            workflow.logger.warning("deployment %s slot %d: %s", model, slot.slot, slot.last_reason)
        elif what is SlotEnd.REAPED:
            decision("deployment.reap", model=model, slot=slot.slot,
                     replica=slot.replica_id, reason=slot.last_reason)  # fmt: skip
            workflow.logger.warning(
                "deployment %s slot %d reaped after %d failures: %s",
                model,
                slot.slot,
                slot.consecutive_failures,
                slot.last_reason,
            )
        else:
            delay = backoff_s(slot.consecutive_failures, policy)
            decision("deployment.restart_scheduled", model=model, slot=slot.slot,
                     after_s=delay, reason=slot.last_reason)  # fmt: skip


async def _outcome(
    number: int, handle: ChildWorkflowHandle[object, ReplicaStatus]
) -> ReplicaOutcome:
    try:
        return number, await handle, ""
    except ChildWorkflowError as err:
        return number, None, str(err.cause or err)
