"""Client-side replica operations used by the CLI: deploy, watch, list, stop."""

import asyncio
import contextlib
import re
import secrets
from collections.abc import Callable
from datetime import timedelta

from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
)
from temporalio.service import RPCError, RPCStatusCode

from llmgw import contracts
from llmgw import search_attributes as sa
from llmgw.errors import EngineError
from llmgw.queues import (
    CONTROL_QUEUE,
    FLEET_WORKFLOW_ID,
    deployment_workflow_id,
    replica_workflow_id,
)
from llmgw.types import (
    TERMINAL_PHASES,
    CordonInput,
    DeploymentInput,
    DeploymentStatus,
    DrainNodeInput,
    DrainNodeResult,
    FetchProgressDetail,
    FleetSnapshot,
    ModelSpec,
    ReplicaInput,
    ReplicaMemo,
    ReplicaPhase,
    ReplicaStatus,
    ReplicaTimeouts,
    RestartPolicy,
    RollingRestartInput,
    ScaleInput,
    SetAutoscaleInput,
    ShardLogsInput,
    ShardRef,
    StopReplicaInput,
    WakeInput,
    WakeResult,
)
from llmgw.types.pull import ModelPullInput, ModelPullResult, pull_activity_id

PhaseCallback = Callable[[ReplicaMemo], None]


def new_replica_id(model: str) -> str:
    """``<model>-<8 hex>``, safe in workflow ids, file names and log lines."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "model"
    return f"{safe}-{secrets.token_hex(4)}"


async def start_replica(
    client: Client, spec: ModelSpec, timeouts: ReplicaTimeouts | None = None
) -> str:
    """Start one replica's workflow; returns the replica id."""
    replica_id = new_replica_id(spec.name)
    await contracts.REPLICA.start(
        client,
        ReplicaInput(replica_id=replica_id, model=spec, timeouts=timeouts or ReplicaTimeouts()),
        id=replica_workflow_id(replica_id),
        task_queue=CONTROL_QUEUE,
        search_attributes=TypedSearchAttributes(
            [
                SearchAttributePair(sa.REPLICA_MODEL, spec.name),
                SearchAttributePair(sa.REPLICA_STATE, ReplicaPhase.PLACING.value),
            ]
        ),
    )
    return replica_id


async def replica_memo(client: Client, replica_id: str) -> ReplicaMemo | None:
    """A replica's published state, from describe + memo (cheap, needs no worker)."""
    desc = await client.get_workflow_handle(replica_workflow_id(replica_id)).describe(
        rpc_timeout=timedelta(seconds=5)
    )
    return contracts.REPLICA_MEMO.decode(await desc.memo())


async def wait_ready(
    client: Client,
    replica_id: str,
    timeout_s: float,
    on_change: PhaseCallback | None = None,
    poll_s: float = 0.25,
) -> ReplicaMemo:
    """Wait until the replica is ready; raise EngineError with the reason if it fails."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last: ReplicaPhase | None = None
    while True:
        memo = await replica_memo(client, replica_id)
        if memo is not None and memo.phase != last:
            last = memo.phase
            if on_change:
                on_change(memo)
        if memo is not None and memo.phase is ReplicaPhase.READY:
            return memo
        if memo is not None and memo.phase in TERMINAL_PHASES:
            status = await status_of(client, replica_id)
            raise EngineError(
                f"replica {replica_id} {memo.phase}: {status.reason if status else ''}"
            )
        if asyncio.get_running_loop().time() > deadline:
            raise EngineError(f"replica {replica_id} not ready after {timeout_s:.0f}s")
        await asyncio.sleep(poll_s)


async def status_of(client: Client, replica_id: str) -> ReplicaStatus | None:
    """The full state by query while running, else the workflow's result."""
    handle = client.get_workflow_handle(replica_workflow_id(replica_id), result_type=ReplicaStatus)
    desc = await handle.describe(rpc_timeout=timedelta(seconds=5))
    if desc.status == WorkflowExecutionStatus.RUNNING:
        # Bounded: a query blocks ~30 s when no control worker is up.
        return await contracts.REPLICA_STATUS.ask(handle, None, rpc_timeout=timedelta(seconds=5))
    if desc.status == WorkflowExecutionStatus.COMPLETED:
        final: ReplicaStatus = await handle.result()
        return final
    return None


async def fetch_progress(client: Client, replica_id: str) -> list[FetchProgressDetail]:
    """What the replica's weights fetches last heartbeated (one per node fetching):
    the pending ``fetch_weights`` activities of its workflow, as the Temporal UI
    shows them. Empty once no fetch is in flight, or before bytes move."""
    found = await _fetches(client, replica_workflow_id(replica_id))
    return list(found.values())


async def _fetches(client: Client, workflow_id: str) -> dict[str, FetchProgressDetail]:
    """The last heartbeat of each pending ``fetch_weights`` activity, by activity id."""
    handle = client.get_workflow_handle(workflow_id)
    desc = await handle.describe(rpc_timeout=timedelta(seconds=5))
    found: dict[str, FetchProgressDetail] = {}
    for pending in desc.raw_description.pending_activities:
        if pending.activity_type.name != contracts.FETCH_WEIGHTS.name:
            continue
        payloads = list(pending.heartbeat_details.payloads)
        if not payloads:
            continue
        (detail,) = await client.data_converter.decode(payloads[-1:])
        if isinstance(detail, dict):
            with contextlib.suppress(ValidationError):
                found[pending.activity_id] = FetchProgressDetail.model_validate(detail)
    return found


def pull_workflow_id(spec: ModelSpec) -> str:
    """One pull of a model's pinned artifact at a time: a second joins it."""
    artifact = spec.pin.artifact_id().removeprefix("sha256:")[:16] if spec.pin else "local"
    return f"model-pull-{spec.name}-{artifact}"


async def start_pull(client: Client, request: ModelPullInput) -> str:
    """Start (or join) the ModelPull job; its workflow id."""
    workflow_id = pull_workflow_id(request.model)
    await contracts.MODEL_PULL.start(
        client,
        request,
        id=workflow_id,
        task_queue=CONTROL_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        rpc_timeout=timedelta(seconds=10),
    )
    return workflow_id


async def pull_progress(client: Client, workflow_id: str) -> dict[str, FetchProgressDetail]:
    """Each node's last progress in the pull, by node id (nodes not fetching now
    are left out)."""
    found = await _fetches(client, workflow_id)
    prefix = pull_activity_id("")
    return {a.removeprefix(prefix): d for a, d in found.items() if a.startswith(prefix)}


async def pull_result(client: Client, workflow_id: str, poll_s: float) -> ModelPullResult | None:
    """The pull's result once it has ended (None while it runs), waiting at most ``poll_s``."""
    handle = client.get_workflow_handle(workflow_id, result_type=ModelPullResult)
    try:
        result: ModelPullResult = await asyncio.wait_for(handle.result(), poll_s)
    except TimeoutError:
        return None
    return result


async def list_replicas(client: Client, include_closed: bool = False) -> list[ReplicaMemo]:
    """Replicas as their memos say, newest first."""
    query = f'WorkflowType="{contracts.REPLICA.name}"'
    if not include_closed:
        query += ' AND ExecutionStatus="Running"'
    found: list[ReplicaMemo] = []
    async for wf in client.list_workflows(query, rpc_timeout=timedelta(seconds=5)):
        memo = contracts.REPLICA_MEMO.decode(await wf.memo())
        if memo is not None:
            found.append(memo)
    return found


async def stop_replica(
    client: Client, replica_id: str, reason: str, timeout_s: float
) -> ReplicaStatus:
    """Ask a replica to drain and stop; returns once it has stopped."""
    handle = client.get_workflow_handle(replica_workflow_id(replica_id))
    try:
        return await asyncio.wait_for(
            contracts.STOP.execute(handle, StopReplicaInput(reason=reason)),
            timeout_s,
        )
    except RPCError as exc:
        raise EngineError(f"cannot stop {replica_id}: {exc}") from exc


async def fleet_snapshot(client: Client) -> FleetSnapshot:
    """The fleet's inventory and allocations (a query: needs a control worker)."""
    handle = client.get_workflow_handle(FLEET_WORKFLOW_ID)
    return await contracts.SNAPSHOT.ask(handle, None, rpc_timeout=timedelta(seconds=5))


async def wait_node_registered(client: Client, node_id: str, timeout_s: float) -> None:
    """Wait until ``node_id`` has registered with the fleet."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            snap = await fleet_snapshot(client)
            seen = snap.liveness.get(node_id)
            if node_id in snap.nodes and (seen is None or seen.up):
                return
        except RPCError:
            pass  # the fleet or the control worker is not up yet
        if asyncio.get_running_loop().time() > deadline:
            raise EngineError(f"node {node_id} did not register within {timeout_s:.0f}s")
        await asyncio.sleep(0.2)


async def log_tail(client: Client, replica_id: str, lines: int) -> list[str]:
    """The last lines of a replica's engine log, fetched from its node."""
    memo = await replica_memo(client, replica_id)
    if memo is None or not memo.node_id:
        raise EngineError(f"replica {replica_id} has not been placed on a node")
    tail = await contracts.SHARD_LOGS.execute(
        client,
        ShardLogsInput(node_id=memo.node_id, shard=ShardRef(replica_id=replica_id), lines=lines),
        id=f"logs/{replica_id}/{secrets.token_hex(4)}",
        task_queue=CONTROL_QUEUE,
        execution_timeout=timedelta(seconds=30),
    )
    return tail.lines


async def apply_deployment(
    client: Client,
    spec: ModelSpec,
    replicas: int,
    timeouts: ReplicaTimeouts | None = None,
    restart: RestartPolicy | None = None,
) -> DeploymentStatus:
    """Start the model's deployment, or scale it if it runs already.

    With ``spec.autoscale`` the deployment follows the load within its
    bounds: it starts with ``replicas`` clamped to them and is sent the
    policy (``set_autoscale``), never a count, so the autoscaler's count
    stands. Without, ``replicas`` is a fixed count (``scale``; autoscaling
    stops). A fixed-count deployment scaled to zero ends once its replicas
    drained, so an update can race its close: then the next attempt starts
    a new run.
    """
    policy = spec.autoscale
    if policy is not None:
        replicas = max(policy.min_replicas, min(policy.max_replicas, replicas))
    last: RPCError | None = None
    for _ in range(3):
        if policy is None and replicas == 0 and not await _deployment_running(client, spec.name):
            return DeploymentStatus(model=spec.name, desired=0)
        handle = await contracts.DEPLOYMENT.start(
            client,
            DeploymentInput(
                model=spec,
                replicas=replicas,
                timeouts=timeouts or ReplicaTimeouts(),
                restart=restart or RestartPolicy(),
            ),
            id=deployment_workflow_id(spec.name),
            task_queue=CONTROL_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        try:
            if policy is not None:
                status = await contracts.SET_AUTOSCALE.execute(
                    handle, SetAutoscaleInput(policy=policy)
                )
            else:
                status = await contracts.SCALE.execute(handle, ScaleInput(replicas=replicas))
            return status
        except RPCError as exc:
            last = exc
            await asyncio.sleep(0.2)
    raise EngineError(f"cannot scale deployment/{spec.name}: {last}")


async def _deployment_running(client: Client, model: str) -> bool:
    try:
        desc = await client.get_workflow_handle(deployment_workflow_id(model)).describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return desc.status == WorkflowExecutionStatus.RUNNING


async def deployment_status(client: Client, model: str) -> DeploymentStatus:
    """A deployment's slots, restarts and last failure reasons."""
    handle = client.get_workflow_handle(deployment_workflow_id(model))
    return await contracts.DEPLOYMENT_STATUS.ask(handle, None, rpc_timeout=timedelta(seconds=5))


async def list_deployments(client: Client) -> list[DeploymentStatus]:
    """Every running deployment's state; one that cannot answer is left out."""
    found: list[DeploymentStatus] = []
    query = f"WorkflowType = '{contracts.DEPLOYMENT.name}' AND ExecutionStatus = 'Running'"
    async for wf in client.list_workflows(query, rpc_timeout=timedelta(seconds=5)):
        model = wf.id.removeprefix(deployment_workflow_id(""))
        try:
            found.append(await deployment_status(client, model))
        except RPCError:
            continue  # ending, or no control worker: the replicas table still shows it
    return found


async def wait_deployment_ready(
    client: Client, model: str, timeout_s: float, on_change: PhaseCallback | None = None
) -> ReplicaMemo:
    """Wait until the deployment's first slot serves, across restarts of its replica."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise EngineError(f"deployment of {model} not ready after {timeout_s:.0f}s")
        try:
            status = await deployment_status(client, model)
        except RPCError:
            status = None  # not started yet, or the control worker is starting
        slot = status.slots[0] if status and status.slots else None
        if slot is not None and slot.reaped:
            raise EngineError(f"deployment of {model} gave up: {slot.last_reason}")
        if slot is None or not slot.replica_id:
            await asyncio.sleep(0.2)
            continue
        try:
            return await wait_ready(client, slot.replica_id, remaining, on_change)
        except EngineError:
            await asyncio.sleep(0.2)  # the deployment replaces it; follow the next one


async def drain_node(client: Client, node_id: str, timeout_s: float) -> DrainNodeResult:
    """Run the DrainNode job: cordon, then drain every replica on the node."""
    return await contracts.DRAIN_NODE.execute(
        client,
        DrainNodeInput(node_id=node_id, timeout_s=timeout_s),
        id=f"drain-node/{node_id}/{secrets.token_hex(4)}",
        task_queue=CONTROL_QUEUE,
    )


async def cordon(client: Client, node_id: str, cordoned: bool) -> FleetSnapshot:
    """Cordon or uncordon a node."""
    handle = client.get_workflow_handle(FLEET_WORKFLOW_ID)
    return await contracts.CORDON.execute(handle, CordonInput(node_id=node_id, cordoned=cordoned))


async def wake(client: Client, model: str, reason: str, timeout_s: float) -> WakeResult:
    """Ask an autoscaled deployment at zero for a replica; returns once one
    serves or the start failed (what a router does for its waiting requests)."""
    handle = client.get_workflow_handle(deployment_workflow_id(model))
    return await asyncio.wait_for(
        contracts.WAKE.execute(handle, WakeInput(router_id="cli", reason=reason)), timeout_s
    )


async def rolling_restart(client: Client, model: str, reason: str) -> DeploymentStatus:
    """Replace every replica of the deployment, one at a time."""
    handle = client.get_workflow_handle(deployment_workflow_id(model))
    return await contracts.ROLLING_RESTART.execute(handle, RollingRestartInput(reason=reason))


async def remove_deployment(client: Client, spec: ModelSpec, timeout_s: float) -> DeploymentStatus:
    """Scale the deployment to zero and wait until its replicas drained and it ended
    (a fixed count of zero: an autoscaled deployment at zero keeps running)."""
    await apply_deployment(client, spec.model_copy(update={"autoscale": None}), 0)
    handle = client.get_workflow_handle(
        deployment_workflow_id(spec.name), result_type=DeploymentStatus
    )
    try:
        final: DeploymentStatus = await asyncio.wait_for(handle.result(), timeout_s)
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        return DeploymentStatus(model=spec.name, desired=0)  # there was none
    return final
