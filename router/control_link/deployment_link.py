"""How a router talks to a model's Deployment workflow about elastic serving.

Two messages only, both off the request path: a load report (signal
``report_load``, at most once a second per model, router/control_link/load_report.py)
and a wake (update ``wake``, once per model however many requests wait,
router/admission/wake.py). Tests inject their own :class:`DeploymentLink`.
"""

import asyncio
import logging
import uuid
from datetime import timedelta
from typing import Any, Protocol

from temporalio.client import (
    Client,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.service import RPCError, RPCStatusCode

from llmgw import contracts
from llmgw.queues import deployment_workflow_id
from llmgw.types import LoadReport, WakeInput, WakeResult

log = logging.getLogger(__name__)

# Each call to Temporal is bounded: a slow Temporal delays a report or a
# wake, never a request (the queue's own max_wait_s bounds the wait).
RPC_TIMEOUT = timedelta(seconds=5)
# A wake starts an engine: loading weights may take minutes.
WAKE_TIMEOUT_S = 900.0


class DeploymentLink(Protocol):
    """The Deployment workflows as one router sees them."""

    async def report(self, model: str, report: LoadReport) -> None:
        """Send this router's latest load on ``model`` (dropped on failure)."""
        ...

    async def wake(self, model: str, wake: WakeInput) -> WakeResult:
        """Ask the deployment of ``model`` for a ready replica; returns once one
        is ready or its start failed."""
        ...


class TemporalDeploymentLink:
    """Signals and updates ``deployment/<model>`` through a Temporal client."""

    def __init__(
        self,
        client: Client,
        rpc_timeout: timedelta = RPC_TIMEOUT,
        wake_timeout_s: float = WAKE_TIMEOUT_S,
    ) -> None:
        self._client = client
        self._rpc_timeout = rpc_timeout
        self._wake_timeout_s = wake_timeout_s

    async def report(self, model: str, report: LoadReport) -> None:
        """One signal; a failure raises (the reporter logs and drops it)."""
        handle = self._client.get_workflow_handle(deployment_workflow_id(model))
        await contracts.REPORT_LOAD.send(handle, report, rpc_timeout=self._rpc_timeout)

    async def wake(self, model: str, wake: WakeInput) -> WakeResult:
        """The ``wake`` update's result; any failure becomes ``ready=False`` with why."""
        handle = self._client.get_workflow_handle(deployment_workflow_id(model))
        # One id for every attempt: Temporal dedupes an update by its id, so
        # asking again after a call's deadline joins the same wake.
        update_id = f"wake-{wake.router_id}-{uuid.uuid4().hex}"
        try:
            async with asyncio.timeout(self._wake_timeout_s):
                while True:
                    try:
                        return await self._wake_once(handle, wake, update_id)
                    except WorkflowUpdateRPCTimeoutOrCancelledError as exc:
                        if isinstance(exc.__cause__, asyncio.CancelledError):
                            raise exc.__cause__ from None  # ours: the timeout, or a stop
                        # One call's deadline passed (the control worker is
                        # down, or the engine still loads): ask again.
                        log.info("wake of %s: no answer yet, asking again", model)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return WakeResult(ready=False, reason=f"the model `{model}` has no deployment")
            log.warning("wake of %s: Temporal did not answer: %s", model, exc)
            return WakeResult(ready=False, reason=f"Temporal did not answer: {exc.message}")
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause or exc
            return WakeResult(ready=False, reason=f"the deployment refused the wake: {cause}")
        except TimeoutError:
            return WakeResult(
                ready=False, reason=f"no replica became ready within {self._wake_timeout_s:g} s"
            )

    async def _wake_once(
        self, handle: WorkflowHandle[Any, Any], wake: WakeInput, update_id: str
    ) -> WakeResult:
        """Start (or join) the wake and wait for its answer. Each call is bounded
        by the RPC timeout; past it the SDK raises (it does not poll again)."""
        update = await contracts.WAKE.start(
            handle,
            wake,
            id=update_id,
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            rpc_timeout=self._rpc_timeout,
        )
        return WakeResult.model_validate(await update.result(rpc_timeout=self._rpc_timeout))
