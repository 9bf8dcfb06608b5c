"""What crosses Temporal between processes, each name paired with its types.

A workflow type, signal, update, query, activity or memo key is one
descriptor here: its name (what the wire and stored histories carry), its
input type and its result type. The handler names it
(``@workflow.update(name=SCALE.name)``, ``@activity.defn(name=LAUNCH_SHARD.name)``)
and the sender calls through it (``await SCALE.execute(handle, arg)``), so the
two sides cannot disagree on a string or on what it carries; the handlers'
annotations are checked against these types by tests/test_contracts.py.

The name values are part of stored workflow histories and of running
workflows on upgraded clusters: never change one (tests/control/test_replay.py
replays them, tests/test_contracts.py pins them).

Workflows import this module through ``workflow.unsafe.imports_passed_through()``:
it holds no state, and :meth:`Activity.run`, :meth:`WorkflowType.start_child`
and the workflow-side :meth:`Signal.send` only call the deterministic
``temporalio.workflow`` API.
"""

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, RootModel
from temporalio import workflow
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateHandle, WorkflowUpdateStage
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from llmgw.types import (
    AdapterCall,
    AdapterCallResult,
    AdapterLoadInput,
    AdapterLoadResult,
    AdaptersChanged,
    BatchId,
    BatchMemo,
    BatchRun,
    BatchRunResult,
    BatchState,
    BatchStatusChange,
    BatchValidation,
    CancelJob,
    ChunkRange,
    ChunkResult,
    CordonInput,
    DeploymentInput,
    DeploymentStatus,
    DrainInput,
    DrainNodeInput,
    DrainNodeResult,
    DrainResult,
    FetchWeightsInput,
    FetchWeightsResult,
    FinalizeBatch,
    Finalized,
    FleetSnapshot,
    LaunchShardInput,
    LoadReport,
    LogTail,
    LogTailInput,
    NodeInventory,
    NodeRef,
    NodesQuery,
    NodesResult,
    PlaceBatch,
    PlaceBatchResult,
    PlaceRequest,
    PlaceResult,
    PortReservation,
    ProbeEngineInput,
    ProbeEngineResult,
    ReleaseRequest,
    ReleaseResult,
    RendezvousInput,
    RendezvousResult,
    ReplicaInput,
    ReplicaMemo,
    ReplicaReadyNotice,
    ReplicaStatus,
    ResponseRun,
    ResponseRunResult,
    RollingRestartInput,
    ScaleInput,
    SetAutoscaleInput,
    SetModelInput,
    ShardExit,
    ShardHandle,
    ShardLoad,
    ShardLogsInput,
    ShardRef,
    ShardRunning,
    StopReplicaInput,
    StopShardInput,
    StopShardResult,
    ValidateInput,
    ValidateResult,
    WaitReadyInput,
    WaitReadyResult,
    WakeInput,
    WakeResult,
    WatchShardInput,
)
from llmgw.types.pull import ModelPullInput, ModelPullResult

I = TypeVar("I")  # noqa: E741 - the input type, as in Update[I, R]
R = TypeVar("R")
W = TypeVar("W")  # another workflow type's input
M = TypeVar("M", bound=BaseModel)

# Who can be signalled: a client's handle, or, inside a workflow, a child's
# or another workflow's.
SignalTarget = (
    WorkflowHandle[Any, Any]
    | workflow.ExternalWorkflowHandle[Any]
    | workflow.ChildWorkflowHandle[Any, Any]
)


@dataclass(frozen=True)
class WorkflowType(Generic[I, R]):
    """A workflow type: its run method takes ``input`` and returns ``result``."""

    name: str
    input: type[I]
    result: type[R]

    async def start(
        self, client: Client, arg: I, *, id: str, task_queue: str, **options: Any
    ) -> WorkflowHandle[Any, R]:
        """Start it from a client (``options`` as ``Client.start_workflow`` takes them)."""
        handle: WorkflowHandle[Any, R] = await client.start_workflow(
            self.name, arg, id=id, task_queue=task_queue, result_type=self.result, **options
        )
        return handle

    async def start_once(
        self, client: Client, arg: I, *, id: str, task_queue: str, rpc_timeout: timedelta
    ) -> None:
        """Start it unless a workflow with ``id`` runs or ran already: one that
        runs is joined (USE_EXISTING), a finished one's id is refused and the
        refusal is no error. Safe to repeat: the jobs' starts (the router's,
        and the sweeper's for the rows no router started) go through here."""
        with contextlib.suppress(WorkflowAlreadyStartedError):
            await self.start(
                client, arg, id=id, task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                rpc_timeout=rpc_timeout,
            )  # fmt: skip

    async def execute(
        self, client: Client, arg: I, *, id: str, task_queue: str, **options: Any
    ) -> R:
        """Run it from a client and return its result."""
        result: R = await client.execute_workflow(
            self.name, arg, id=id, task_queue=task_queue, result_type=self.result, **options
        )
        return result

    async def start_child(
        self, arg: I, *, id: str, **options: Any
    ) -> workflow.ChildWorkflowHandle[Any, R]:
        """Start it as a child of the calling workflow."""
        handle: workflow.ChildWorkflowHandle[Any, R] = await workflow.start_child_workflow(
            self.name, arg, id=id, result_type=self.result, **options
        )
        return handle

    async def execute_child(self, arg: I, *, id: str, **options: Any) -> R:
        """Run it as a child of the calling workflow and return its result."""
        result: R = await workflow.execute_child_workflow(
            self.name, arg, id=id, result_type=self.result, **options
        )
        return result


@dataclass(frozen=True)
class Signal(Generic[I]):
    """A signal to workflow type ``workflow`` carrying ``input``."""

    workflow: str
    name: str
    input: type[I]

    async def send(
        self, handle: SignalTarget, arg: I, *, rpc_timeout: timedelta | None = None
    ) -> None:
        """Signal ``handle`` (``rpc_timeout`` applies to a client's handle only)."""
        if isinstance(handle, WorkflowHandle):
            await handle.signal(self.name, arg, rpc_timeout=rpc_timeout)
        else:
            await handle.signal(self.name, arg)

    async def send_with_start(
        self,
        client: Client,
        workflow_type: WorkflowType[W, Any],
        start_arg: W,
        arg: I,
        *,
        id: str,
        task_queue: str,
        **options: Any,
    ) -> WorkflowHandle[Any, Any]:
        """Signal-with-start: start ``workflow_type`` with ``start_arg`` unless
        ``id`` runs (``options`` such as ``id_conflict_policy``), then signal it."""
        if workflow_type.name != self.workflow:
            raise ValueError(
                f"{self.name} is a signal of {self.workflow}, not {workflow_type.name}"
            )
        handle: WorkflowHandle[Any, Any] = await client.start_workflow(
            workflow_type.name,
            start_arg,
            id=id,
            task_queue=task_queue,
            start_signal=self.name,
            start_signal_args=[arg],
            **options,
        )
        return handle


@dataclass(frozen=True)
class Update(Generic[I, R]):
    """An update of workflow type ``workflow``: takes ``input``, returns ``result``."""

    workflow: str
    name: str
    input: type[I]
    result: type[R]

    async def execute(
        self, handle: WorkflowHandle[Any, Any], arg: I, *, rpc_timeout: timedelta | None = None
    ) -> R:
        """Run the update and return its result."""
        result: R = await handle.execute_update(
            self.name, arg, result_type=self.result, rpc_timeout=rpc_timeout
        )
        return result

    async def start(
        self,
        handle: WorkflowHandle[Any, Any],
        arg: I,
        *,
        wait_for_stage: WorkflowUpdateStage,
        id: str | None = None,
        rpc_timeout: timedelta | None = None,
    ) -> WorkflowUpdateHandle[R]:
        """Start the update (or join the one with ``id``) and return its handle."""
        return await handle.start_update(
            self.name,
            arg,
            wait_for_stage=wait_for_stage,
            id=id,
            result_type=self.result,
            rpc_timeout=rpc_timeout,
        )


@dataclass(frozen=True)
class Query(Generic[I, R]):
    """A query of workflow type ``workflow``; ``input`` is ``NoneType`` for one
    that takes no argument (its handler takes none)."""

    workflow: str
    name: str
    input: type[I]
    result: type[R]

    async def ask(
        self, handle: WorkflowHandle[Any, Any], arg: I, *, rpc_timeout: timedelta | None = None
    ) -> R:
        """Query ``handle``; pass ``None`` as ``arg`` for a query without one."""
        if arg is None:
            result: R = await handle.query(
                self.name, result_type=self.result, rpc_timeout=rpc_timeout
            )
        else:
            result = await handle.query(
                self.name, arg, result_type=self.result, rpc_timeout=rpc_timeout
            )
        return result


@dataclass(frozen=True)
class Activity(Generic[I, R]):
    """An activity: takes ``input``, returns ``result``."""

    name: str
    input: type[I]
    result: type[R]

    async def run(self, arg: I, **options: Any) -> R:
        """Run it from the calling workflow (``options`` as ``workflow.execute_activity``
        takes them: task queue, timeouts, retry policy)."""
        result: R = await workflow.execute_activity(
            self.name, arg, result_type=self.result, **options
        )
        return result


@dataclass(frozen=True)
class Memo(Generic[M]):
    """A memo key and the model its value is."""

    key: str
    model: type[M]

    def encode(self, value: M) -> dict[str, Any]:
        """``value`` as ``upsert_memo`` / ``start_workflow(memo=...)`` take it."""
        return {self.key: value.model_dump(mode="json")}

    def decode(self, memo: Mapping[str, Any]) -> M | None:
        """This key's value from a decoded memo; None when absent or not an
        object. A malformed object raises pydantic's ``ValidationError``."""
        return self.parse(memo.get(self.key))

    def parse(self, value: object) -> M | None:
        """An already-decoded memo value as the model (None: absent or not an
        object; malformed raises ``ValidationError``)."""
        if not isinstance(value, dict):
            return None
        return self.model.model_validate(value)


NoInput = type(None)

# --- Workflow types --------------------------------------------------------

FLEET = WorkflowType("Fleet", FleetSnapshot, FleetSnapshot)
REPLICA = WorkflowType("Replica", ReplicaInput, ReplicaStatus)
DEPLOYMENT = WorkflowType("Deployment", DeploymentInput, DeploymentStatus)
RENDEZVOUS = WorkflowType("Rendezvous", RendezvousInput, RendezvousResult)
DRAIN_NODE = WorkflowType("DrainNode", DrainNodeInput, DrainNodeResult)
MODEL_PULL = WorkflowType("ModelPull", ModelPullInput, ModelPullResult)
ADAPTER_LOAD = WorkflowType("AdapterLoad", AdapterLoadInput, AdapterLoadResult)
SHARD_LOGS = WorkflowType("ShardLogs", ShardLogsInput, LogTail)
# Durable OpenAI jobs, on the exec queue (ids: llmgw.queues.batch_workflow_id,
# response_workflow_id).
BATCH = WorkflowType("Batch", BatchRun, BatchRunResult)
RESPONSE = WorkflowType("BackgroundResponse", ResponseRun, ResponseRunResult)

WORKFLOWS: tuple[WorkflowType[Any, Any], ...] = (
    FLEET, REPLICA, DEPLOYMENT, RENDEZVOUS, DRAIN_NODE, MODEL_PULL, ADAPTER_LOAD, SHARD_LOGS,
    BATCH, RESPONSE,
)  # fmt: skip

# --- Fleet: signals from the agents, updates and queries from control and CLI

REGISTER_NODE = Signal(FLEET.name, "register_node", NodeInventory)
DEREGISTER_NODE = Signal(FLEET.name, "deregister_node", NodeRef)
PLACE = Update(FLEET.name, "place", PlaceRequest, PlaceResult)
PLACE_BATCH = Update(FLEET.name, "place_batch", PlaceBatch, PlaceBatchResult)
RELEASE = Update(FLEET.name, "release", ReleaseRequest, ReleaseResult)
CORDON = Update(FLEET.name, "cordon", CordonInput, FleetSnapshot)
SNAPSHOT = Query(FLEET.name, "snapshot", NoInput, FleetSnapshot)
NODES = Query(FLEET.name, "nodes", NodesQuery, NodesResult)

# --- Replica ----------------------------------------------------------------

STOP = Update(REPLICA.name, "stop", StopReplicaInput, ReplicaStatus)
REQUEST_STOP = Signal(REPLICA.name, "request_stop", StopReplicaInput)
ADAPTERS_CHANGED = Signal(REPLICA.name, "adapters_changed", AdaptersChanged)
REPLICA_STATUS = Query(REPLICA.name, "status", NoInput, ReplicaStatus)

# --- Deployment: signals from its replicas, updates from the CLI and reconcile;
# elastic serving: load from the routers, a wake from a router holding
# requests for a model at zero, and the autoscale bounds.

REPLICA_READY = Signal(DEPLOYMENT.name, "replica_ready", ReplicaReadyNotice)
REPLICA_ENDED = Signal(DEPLOYMENT.name, "replica_ended", ReplicaStatus)
SCALE = Update(DEPLOYMENT.name, "scale", ScaleInput, DeploymentStatus)
SET_MODEL = Update(DEPLOYMENT.name, "set_model", SetModelInput, DeploymentStatus)
ROLLING_RESTART = Update(DEPLOYMENT.name, "rolling_restart", RollingRestartInput, DeploymentStatus)
DEPLOYMENT_STATUS = Query(DEPLOYMENT.name, "status", NoInput, DeploymentStatus)
REPORT_LOAD = Signal(DEPLOYMENT.name, "report_load", LoadReport)
WAKE = Update(DEPLOYMENT.name, "wake", WakeInput, WakeResult)
SET_AUTOSCALE = Update(DEPLOYMENT.name, "set_autoscale", SetAutoscaleInput, DeploymentStatus)

# --- Jobs: a cancel from the router (fire and forget; the sweeper re-sends).

CANCEL_BATCH = Signal(BATCH.name, "cancel_batch", CancelJob)
CANCEL_RESPONSE = Signal(RESPONSE.name, "cancel_response", CancelJob)

MESSAGES: tuple[Signal[Any] | Update[Any, Any] | Query[Any, Any], ...] = (
    REGISTER_NODE, DEREGISTER_NODE, PLACE, PLACE_BATCH, RELEASE, CORDON, SNAPSHOT, NODES,
    STOP, REQUEST_STOP, ADAPTERS_CHANGED, REPLICA_STATUS,
    REPLICA_READY, REPLICA_ENDED, SCALE, SET_MODEL, ROLLING_RESTART, DEPLOYMENT_STATUS,
    REPORT_LOAD, WAKE, SET_AUTOSCALE, CANCEL_BATCH, CANCEL_RESPONSE,
)  # fmt: skip

# --- Activities: control queue ------------------------------------------------

PLACE_REPLICA = Activity("place_replica", PlaceRequest, PlaceResult)
RELEASE_REPLICA = Activity("release_replica", ReleaseRequest, ReleaseResult)
VALIDATE_REPLICA = Activity("validate_replica", ValidateInput, ValidateResult)
FLEET_CORDON = Activity("fleet_cordon", CordonInput, FleetSnapshot)
PROBE_ENGINE = Activity("probe_engine", ProbeEngineInput, ProbeEngineResult)

# --- Activities: node queues (node-<id>) --------------------------------------

FETCH_WEIGHTS = Activity("fetch_weights", FetchWeightsInput, FetchWeightsResult)
RESERVE_PORT = Activity("reserve_port", ShardRef, PortReservation)
LAUNCH_SHARD = Activity("launch_shard", LaunchShardInput, ShardHandle)
WAIT_SHARD_READY = Activity("wait_shard_ready", WaitReadyInput, WaitReadyResult)
WATCH_SHARD = Activity("watch_shard", WatchShardInput, ShardExit)
STOP_SHARD = Activity("stop_shard", StopShardInput, StopShardResult)
DRAIN_SHARD = Activity("drain_shard", DrainInput, DrainResult)
SHARD_LOG_TAIL = Activity("shard_log_tail", LogTailInput, LogTail)
SHARD_LOAD = Activity("shard_load", ShardRef, ShardLoad)
SHARD_RUNNING = Activity("shard_running", ShardRef, ShardRunning)
LOAD_ADAPTER = Activity("load_adapter", AdapterCall, AdapterCallResult)
UNLOAD_ADAPTER = Activity("unload_adapter", AdapterCall, AdapterCallResult)

# --- Activities: exec queue (activities/control/jobs.py) ----------------------

VALIDATE_BATCH = Activity("validate_batch", BatchId, BatchValidation)
SET_BATCH_STATUS = Activity("set_batch_status", BatchStatusChange, BatchState)
RUN_CHUNK = Activity("run_chunk", ChunkRange, ChunkResult)
FINALIZE_BATCH = Activity("finalize_batch", FinalizeBatch, Finalized)
RUN_RESPONSE = Activity("run_response", ResponseRun, ResponseRunResult)

ACTIVITIES: tuple[Activity[Any, Any], ...] = (
    PLACE_REPLICA, RELEASE_REPLICA, VALIDATE_REPLICA, FLEET_CORDON, PROBE_ENGINE,
    FETCH_WEIGHTS, RESERVE_PORT, LAUNCH_SHARD, WAIT_SHARD_READY, WATCH_SHARD, STOP_SHARD,
    DRAIN_SHARD, SHARD_LOG_TAIL, SHARD_LOAD, SHARD_RUNNING, LOAD_ADAPTER, UNLOAD_ADAPTER,
    VALIDATE_BATCH, SET_BATCH_STATUS, RUN_CHUNK, FINALIZE_BATCH, RUN_RESPONSE,
)  # fmt: skip


# --- Memos ----------------------------------------------------------------


class FleetNodes(RootModel[dict[str, str]]):
    """Registered nodes' engine addresses (node id -> address), as the Fleet
    publishes them: the router routes only to endpoints on these addresses."""


# Every Replica publishes its phase under this key (the router and CLI read it).
REPLICA_MEMO = Memo("replica", ReplicaMemo)
# The Fleet's registered nodes (a plain object: the RootModel adds no wrapper).
FLEET_NODES_MEMO = Memo("nodes", FleetNodes)
# A batch's progress, upserted per chunk (the Temporal UI shows it).
BATCH_MEMO = Memo("batch", BatchMemo)
