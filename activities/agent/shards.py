"""Node activities: launch, wait-ready, watch and stop engine shards.

Served by the node agent on ``node-<id>``. Only the Temporal layer: each
activity hands its input to the agent's shard service
(``worker_agent/shard_service.py``, where the loops and the supervisor calls
are), with ``activity.heartbeat`` as its heartbeat, and turns the errors the
service documents into the ``ApplicationError`` a workflow matches
(``llmgw/error_types.py``). Anything else is raised as it comes, as Temporal
carries any exception (retryable). Cancellation is asyncio's: Temporal cancels
the activity's task.
"""

from temporalio import activity
from temporalio.exceptions import ApplicationError

from llmgw import contracts, error_types
from llmgw.errors import (
    AgentShutdown,
    ConfigError,
    EngineExitedError,
    EngineNotReadyError,
    LlmgwError,
)
from llmgw.types import (
    DrainInput,
    DrainResult,
    EngineKind,
    FetchWeightsInput,
    FetchWeightsResult,
    LaunchShardInput,
    LogTail,
    LogTailInput,
    PortReservation,
    ShardExit,
    ShardHandle,
    ShardLoad,
    ShardRef,
    ShardRunning,
    StopShardInput,
    StopShardResult,
    WaitReadyInput,
    WaitReadyResult,
    WatchShardInput,
)
from worker_agent.engines import LaunchValidationError
from worker_agent.installs.steps import EngineInstallError
from worker_agent.shard_service import ShardService
from worker_agent.weights import WeightsError


class NodeActivities:
    """The activities of one node over its shard service."""

    def __init__(self, shards: ShardService) -> None:
        self._shards = shards

    async def aclose(self) -> None:
        """Close the shard service (its HTTP client)."""
        await self._shards.aclose()

    @activity.defn(name=contracts.FETCH_WEIGHTS.name)
    async def fetch_weights(self, request: FetchWeightsInput) -> FetchWeightsResult:
        """Bring the weights into the node's cache, verified, heartbeating progress."""
        try:
            return await self._shards.fetch_weights(request, activity.heartbeat)
        except EngineInstallError as err:
            raise _install_failed(request.engine, err) from err
        except ConfigError as err:  # no weights cache
            raise err.to_application_error() from None
        except WeightsError as err:
            raise err.to_application_error() from err

    @activity.defn(name=contracts.RESERVE_PORT.name)
    async def reserve_port(self, ref: ShardRef) -> PortReservation:
        """A port for a shard that peers must know before it starts (idempotent)."""
        return await self._shards.reserve_port(ref)

    @activity.defn(name=contracts.LAUNCH_SHARD.name)
    async def launch_shard(self, request: LaunchShardInput) -> ShardHandle:
        """Start a shard, or return the one already running for it."""
        try:
            return await self._shards.launch(request, activity.heartbeat)
        except EngineInstallError as err:
            raise _install_failed(request.spec.model.engine, err) from err
        except LaunchValidationError as err:
            raise ConfigError(str(err)).to_application_error() from err
        except LlmgwError as err:
            raise err.to_application_error() from err

    @activity.defn(name=contracts.WAIT_SHARD_READY.name)
    async def wait_shard_ready(self, request: WaitReadyInput) -> WaitReadyResult:
        """Wait until the shard serves (or, for a worker rank, stays alive)."""
        try:
            return await self._shards.wait_ready(request, activity.heartbeat)
        except (EngineExitedError, EngineNotReadyError) as err:
            raise err.to_application_error() from None

    @activity.defn(name=contracts.WATCH_SHARD.name)
    async def watch_shard(self, request: WatchShardInput) -> ShardExit:
        """Return when the shard's engine exits, or once it is found hung
        (then stopped; the reason starts with ``ENGINE_HUNG``); heartbeat
        while it runs."""
        try:
            return await self._shards.watch(
                request, activity.heartbeat, activity.is_worker_shutdown
            )
        except AgentShutdown as err:
            raise err.to_application_error() from None

    @activity.defn(name=contracts.DRAIN_SHARD.name)
    async def drain_shard(self, request: DrainInput) -> DrainResult:
        """Wait, bounded, until the engine has no request in flight."""
        return await self._shards.drain(request, activity.heartbeat)

    @activity.defn(name=contracts.SHARD_LOAD.name)
    async def shard_load(self, request: ShardRef) -> ShardLoad:
        """Requests in flight on the shard's engine (a deployment scaling down
        drains the least loaded replica)."""
        return await self._shards.load(request)

    @activity.defn(name=contracts.SHARD_RUNNING.name)
    async def shard_running(self, request: ShardRef) -> ShardRunning:
        """The shard's engine as this agent finds it (a replica whose node was
        lost asks this when the agent is back: same pid means adopted)."""
        return self._shards.running(request)

    @activity.defn(name=contracts.STOP_SHARD.name)
    async def stop_shard(self, request: StopShardInput) -> StopShardResult:
        """Stop the shard's process group; a no-op when it is not running."""
        return await self._shards.stop(request)

    @activity.defn(name=contracts.SHARD_LOG_TAIL.name)
    async def shard_log_tail(self, request: LogTailInput) -> LogTail:
        """The last lines the shard's engine wrote (bounded)."""
        return self._shards.log_tail(request)


def _install_failed(engine: EngineKind | None, err: EngineInstallError) -> ApplicationError:
    # Not retried here: the replica fails with the reason, and its
    # deployment's backoff decides when to try again.
    what = engine.value if engine is not None else "the engine"
    return ApplicationError(
        f"installing {what} failed: {err}",
        type=error_types.ENGINE_INSTALL_ERROR,
        non_retryable=True,
    )
