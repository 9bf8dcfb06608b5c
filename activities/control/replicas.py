"""Control activities: the replica workflow's door to the fleet entity, and
its eyes on an engine whose node has gone quiet.

A workflow cannot send an update to another workflow, so placement goes
through this activity, which does it with a client (placements asked for at
the same time go as one batch update: activities/control/placer.py). The fleet update
is idempotent per replica, so an activity retry cannot double-book a GPU.

``probe_engine`` runs on the control queue, not the node's: it is how the
control plane tells "the agent is silent" from "the engine is dead" (DESIGN
§8) without the agent's help.
"""

import asyncio

import httpx
from opentelemetry import trace
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.control.placer import Placer, fleet_sender
from llmgw import contracts, error_types
from llmgw.bounded_http import fetch
from llmgw.engine_keys import EngineKeySource
from llmgw.errors import EngineAnswerRefused
from llmgw.queues import FLEET_WORKFLOW_ID
from llmgw.types import (
    CordonInput,
    FleetSnapshot,
    NodesQuery,
    PlaceRequest,
    PlaceResult,
    ProbeEngineInput,
    ProbeEngineResult,
    ReleaseRequest,
    ReleaseResult,
    ValidateInput,
    ValidateResult,
)
from worker_agent.engines import launch_problems, node_facts

PROBE_TIMEOUT_S = 3.0
_HEALTH_BYTES = 64 << 10


async def probe_endpoint(
    http: httpx.AsyncClient, endpoint: str, key: str, deadline_s: float = PROBE_TIMEOUT_S
) -> str:
    """Empty when the engine answers ``/health`` through its pass-through, else why not.

    Any answer below 500 is the engine's own (the pass-through says 502 when
    the engine behind it is gone); a 503 of an engine busy loading still counts
    as answering, since a busy engine is not a dead one.
    """
    try:
        # Only the status counts; the engine is an untrusted byte source
        # (llmgw/bounded_http.py): uncompressed, its start only, within deadline_s.
        response = await fetch(
            http, "GET", f"{endpoint}/health", headers={"Authorization": f"Bearer {key}"},
            max_bytes=_HEALTH_BYTES, deadline_s=deadline_s, truncate=True,
        )  # fmt: skip
    except (httpx.HTTPError, EngineAnswerRefused) as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status < 500 or response.status == 503:
        return ""
    return f"HTTP {response.status}"


class ControlActivities:
    """Activities served on the control queue; built with a Temporal client
    and the engine-key function (probes authenticate as the router does)."""

    def __init__(
        self,
        client: Client,
        engine_key: EngineKeySource | None = None,
        placer: Placer | None = None,
    ) -> None:
        self._client = client
        self._engine_key = engine_key
        self._placer = placer or Placer(fleet_sender(client))

    @activity.defn(name=contracts.PROBE_ENGINE.name)
    async def probe_engine(self, request: ProbeEngineInput) -> ProbeEngineResult:
        """Return once the engine has not answered for ``unreachable_s``.

        Heartbeats carry how long it has been silent, so a retry on another
        control worker resumes the count instead of starting it over.
        """
        if self._engine_key is None:
            raise ApplicationError(
                "this control worker has no engine key",
                type=error_types.CONFIG_ERROR,
                non_retryable=True,
            )
        key = await self._engine_key(request.replica_id)
        details = activity.info().heartbeat_details
        silent = float(details[0]) if details else 0.0
        last_error = "no probe yet"
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as http:
            while True:
                began = loop.time()
                error = await probe_endpoint(http, request.endpoint, key)
                if error:
                    last_error = error
                    activity.logger.warning(
                        "replica %s engine not answering for %.0fs: %s",
                        request.replica_id, silent, error,
                    )  # fmt: skip
                else:
                    silent = 0.0
                if silent >= request.unreachable_s:
                    return ProbeEngineResult(last_error=last_error, unanswered_s=silent)
                activity.heartbeat(silent)
                await asyncio.sleep(request.interval_s)
                if error:
                    silent += loop.time() - began

    @activity.defn(name=contracts.PLACE_REPLICA.name)
    async def place_replica(self, request: PlaceRequest) -> PlaceResult:
        """Ask the fleet to place a replica (in one batch with those asked meanwhile)."""
        result = await self._placer.place(request)
        span = trace.get_current_span()
        span.set_attribute("llmgw.replica", request.replica_id)
        span.set_attribute("llmgw.model", request.model.name)
        for rejected in result.rejections:
            span.add_event(
                "node turned down",
                {"llmgw.node": rejected.node_id, "llmgw.reason": rejected.reason},
            )
        if result.preempt:
            span.set_attribute("llmgw.preempting", result.preempt)
        if result.placement:
            span.set_attribute("llmgw.node", result.placement.node_id)
            span.set_attribute("llmgw.gpus", result.placement.gpu_indices)
            activity.logger.info(
                "replica %s placed on %s", request.replica_id, result.placement.node_id
            )
        return result

    @activity.defn(name=contracts.VALIDATE_REPLICA.name)
    async def validate_replica(self, request: ValidateInput) -> ValidateResult:
        """Refuse, before anything starts, a launch that would fail slowly,
        hang or run degraded (mixed GPU types in a TP group, fp8 on GPUs that
        cannot run it, parallelism that does not add up...)."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        shards = request.placement.shards()
        fleet = await contracts.NODES.ask(
            handle, NodesQuery(node_ids=sorted({s.node_id for s in shards}))
        )
        facts = []
        for shard in shards:
            node = fleet.nodes.get(shard.node_id)
            if node is None:
                return ValidateResult(problems=[f"node {shard.node_id} left the fleet"])
            facts.append(node_facts(node, shard.gpu_indices, http_port=0))
        problems = launch_problems(request.model, request.model.profile, facts, request.rendezvous)
        if problems:
            raise ApplicationError(
                "cannot start: " + "; ".join(problems),
                type=error_types.LAUNCH_VALIDATION_ERROR,
                non_retryable=True,
            )
        return ValidateResult()

    @activity.defn(name=contracts.FLEET_CORDON.name)
    async def fleet_cordon(self, request: CordonInput) -> FleetSnapshot:
        """Cordon or uncordon a node (an empty node id only reads the fleet)."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        if not request.node_id:
            return await contracts.SNAPSHOT.ask(handle, None)
        return await contracts.CORDON.execute(handle, request)

    @activity.defn(name=contracts.RELEASE_REPLICA.name)
    async def release_replica(self, request: ReleaseRequest) -> ReleaseResult:
        """Give a replica's allocation back to the fleet."""
        handle = self._client.get_workflow_handle(FLEET_WORKFLOW_ID)
        return await contracts.RELEASE.execute(handle, request)
