"""Recovery: make what runs match the catalog and the ledger match what runs.

The control worker runs :func:`reconcile_once` every
``reconcile_interval_s``. Each pass reads the catalog (store), the fleet's
ledger and the engines agents reported, and the running deployments, then:

- a deployment whose model left the catalog is scaled to zero; one whose
  catalog entry changed is rolled onto the new entry (``set_model``); one
  whose autoscale bounds differ from its entry's is sent them
  (``set_autoscale``), never a count: the autoscaler's count stands;
- a replica no deployment owns is stopped when its model left the catalog
  or its entry changed;
- an allocation (or reservation) whose replica workflow has ended is
  released: a replica workflow that was terminated never released its GPUs;
- a replica whose deployment has ended (terminated: replicas outlive their
  deployment's runs) is stopped; a deployment slot whose replica workflow
  ended without telling it (terminated) is told.

Engines that no workflow owns are stopped by their node's agent (it checks
every registration round). The decisions are pure (:func:`catalog_orders`);
the pass only carries them out, and every action is logged with its reason.
"""

import asyncio
import logging
from collections.abc import Mapping
from datetime import timedelta
from enum import StrEnum

from opentelemetry import trace
from pydantic import BaseModel, Field
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import contracts
from llmgw.queues import FLEET_WORKFLOW_ID, deployment_workflow_id, replica_workflow_id
from llmgw.store import Store
from llmgw.temporal import workflow_running
from llmgw.types import (
    AutoscalePolicy,
    DeploymentStatus,
    FleetSnapshot,
    ModelSpec,
    ReleaseRequest,
    ReplicaPhase,
    ReplicaStatus,
    ScaleInput,
    SetAutoscaleInput,
    SetModelInput,
    ShardReport,
    StopReplicaInput,
)

log = logging.getLogger(__name__)


class Action(StrEnum):
    """What a reconcile pass does about one finding."""

    REMOVE_DEPLOYMENT = "remove_deployment"
    UPDATE_DEPLOYMENT = "update_deployment"
    SET_AUTOSCALE = "set_autoscale"
    STOP_REPLICA = "stop_replica"
    RELEASE = "release"
    NOTIFY_ENDED = "notify_ended"


class Order(BaseModel):
    """One thing to do, and why."""

    action: Action
    target: str
    reason: str
    replica_id: str = Field(default="", description="notify_ended: the replica that ended")


def catalog_orders(
    catalog: Mapping[str, ModelSpec],
    deployments: Mapping[str, str],
    running: list[ShardReport],
    policies: Mapping[str, AutoscalePolicy | None] | None = None,
) -> list[Order]:
    """What to do so that deployments and engines match the catalog.

    ``deployments`` maps a model to the digest of the entry its deployment
    starts replicas from; ``running`` is every engine the agents reported;
    ``policies`` the autoscale bounds each deployment follows (None: a fixed count).
    Engines of a deployed model are the deployment's business (a rolling
    restart replaces them), so only the others are stopped here.
    """
    orders: list[Order] = []
    for model, digest in sorted(deployments.items()):
        entry = catalog.get(model)
        if entry is None:
            reason = f"model {model} left the catalog"
            orders.append(Order(action=Action.REMOVE_DEPLOYMENT, target=model, reason=reason))
        else:
            if entry.digest() != digest:
                reason = f"model {model} changed in the catalog"
                orders.append(Order(action=Action.UPDATE_DEPLOYMENT, target=model, reason=reason))
            if policies is not None and model in policies and policies[model] != entry.autoscale:
                reason = f"model {model}: autoscale {_bounds(entry.autoscale)} in the catalog"
                orders.append(Order(action=Action.SET_AUTOSCALE, target=model, reason=reason))
    for shard in sorted(running, key=lambda s: s.replica_id):
        if shard.rank != 0 or not shard.catalog_digest or shard.model in deployments:
            continue  # ranks stop with their leader; old agents report no digest
        entry = catalog.get(shard.model)
        if entry is None:
            reason = f"model {shard.model} left the catalog"
        elif entry.digest() != shard.catalog_digest:
            reason = f"model {shard.model} changed in the catalog"
        else:
            continue
        orders.append(Order(action=Action.STOP_REPLICA, target=shard.replica_id, reason=reason))
    return orders


def _bounds(policy: AutoscalePolicy | None) -> str:
    if policy is None:
        return "off"
    return f"{policy.min_replicas}..{policy.max_replicas}"


async def ledger_orders(client: Client, fleet: FleetSnapshot) -> list[Order]:
    """Allocations and reservations whose replica workflow has ended."""
    orders = []
    for replica_id in sorted({*fleet.allocations, *fleet.reservations}):
        if await workflow_running(client, replica_workflow_id(replica_id)) is False:
            reason = f"replica {replica_id} is not running"
            orders.append(Order(action=Action.RELEASE, target=replica_id, reason=reason))
    return orders


async def ownership_orders(client: Client, deployments: list[DeploymentStatus]) -> list[Order]:
    """Replicas whose deployment ended, and slots whose replica vanished untold."""
    orders: list[Order] = []
    query = f"WorkflowType = '{contracts.REPLICA.name}' AND ExecutionStatus = 'Running'"
    async for wf in client.list_workflows(query):
        if wf.parent_id and await workflow_running(client, wf.parent_id) is False:
            rid = wf.id.removeprefix(replica_workflow_id(""))
            reason = f"its deployment ({wf.parent_id}) has ended"
            orders.append(Order(action=Action.STOP_REPLICA, target=rid, reason=reason))
    for status in deployments:
        for slot in status.slots:
            if not slot.replica_id or slot.reaped or slot.next_start_at:
                continue  # no replica, or one that ended and was counted already
            if await workflow_running(client, replica_workflow_id(slot.replica_id)) is not False:
                continue
            reason = f"replica {slot.replica_id} ended without notice"
            orders.append(
                Order(
                    action=Action.NOTIFY_ENDED,
                    target=status.model,
                    reason=reason,
                    replica_id=slot.replica_id,
                )
            )
    return orders


async def _deployments(client: Client) -> list[DeploymentStatus]:
    found: list[DeploymentStatus] = []
    query = f"WorkflowType = '{contracts.DEPLOYMENT.name}' AND ExecutionStatus = 'Running'"
    async for wf in client.list_workflows(query):
        try:
            status = await contracts.DEPLOYMENT_STATUS.ask(
                client.get_workflow_handle(wf.id), None, rpc_timeout=timedelta(seconds=5)
            )
        except RPCError as exc:
            log.info("reconcile: cannot read %s: %s", wf.id, exc)
            continue
        found.append(status)
    return found


async def _carry_out(client: Client, order: Order, catalog: Mapping[str, ModelSpec]) -> None:
    log.warning("reconcile: %s %s: %s", order.action.value, order.target, order.reason)
    if order.action is Action.REMOVE_DEPLOYMENT:
        await contracts.SCALE.execute(
            client.get_workflow_handle(deployment_workflow_id(order.target)),
            ScaleInput(replicas=0),
        )
    elif order.action is Action.UPDATE_DEPLOYMENT:
        await contracts.SET_MODEL.execute(
            client.get_workflow_handle(deployment_workflow_id(order.target)),
            SetModelInput(model=catalog[order.target], reason=order.reason),
        )
    elif order.action is Action.SET_AUTOSCALE:
        await contracts.SET_AUTOSCALE.execute(
            client.get_workflow_handle(deployment_workflow_id(order.target)),
            SetAutoscaleInput(policy=catalog[order.target].autoscale),
        )
    elif order.action is Action.NOTIFY_ENDED:
        ended = ReplicaStatus(
            replica_id=order.replica_id,
            model=order.target,
            phase=ReplicaPhase.FAILED,
            reason=order.reason,
        )
        await contracts.REPLICA_ENDED.send(
            client.get_workflow_handle(deployment_workflow_id(order.target)), ended
        )
    elif order.action is Action.STOP_REPLICA:
        await contracts.REQUEST_STOP.send(
            client.get_workflow_handle(replica_workflow_id(order.target)),
            StopReplicaInput(reason=order.reason),
        )
    else:
        await contracts.RELEASE.execute(
            client.get_workflow_handle(FLEET_WORKFLOW_ID), ReleaseRequest(replica_id=order.target)
        )


async def reconcile_once(
    client: Client, store: Store | None, acts: Client | None = None
) -> list[Order]:
    """One pass; ``store`` None leaves the catalog out (ledger audit only).

    Reads go through ``client``, actions through ``acts`` (default: the same):
    a pass that does something is one trace, a span per action beneath it.
    """
    fleet = await contracts.SNAPSHOT.ask(
        client.get_workflow_handle(FLEET_WORKFLOW_ID), None, rpc_timeout=timedelta(seconds=5)
    )
    orders = await ledger_orders(client, fleet)
    deployments = await _deployments(client)
    orders += await ownership_orders(client, deployments)
    catalog: dict[str, ModelSpec] = {}
    if store is not None:
        catalog = await asyncio.to_thread(store.catalog)
        running = [shard for node in fleet.nodes.values() for shard in node.running]
        # A deployment from before digests has none: it is left be.
        digests = {d.model: d.model_digest for d in deployments if d.model_digest}
        policies = {d.model: d.autoscale for d in deployments if d.model_digest}
        orders += catalog_orders(catalog, digests, running, policies)
    if not orders:
        return orders
    tracer = trace.get_tracer(__name__)
    with tracer.start_as_current_span("reconcile", attributes={"llmgw.orders": len(orders)}):
        for order in orders:
            attributes = {"llmgw.target": order.target, "llmgw.reason": order.reason}
            with tracer.start_as_current_span(
                f"reconcile.{order.action.value}", attributes=attributes
            ):
                try:
                    await _carry_out(acts or client, order, catalog)
                except RPCError as exc:  # it may have ended meanwhile; the next pass looks again
                    log.info("reconcile: %s %s: %s", order.action.value, order.target, exc)
    return orders


async def reconcile_forever(
    client: Client, acts: Client, store: Store | None, interval_s: float
) -> None:
    """Reconcile every ``interval_s`` until cancelled; a failed pass is retried next time."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await reconcile_once(client, store, acts)
        except Exception as exc:  # keep the control worker serving
            log.warning("reconcile pass failed: %s", exc)
