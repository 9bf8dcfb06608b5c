"""The control-plane worker: workflows and control activities on ``control``,
and a second Worker on ``exec`` for the durable OpenAI jobs (batches,
background responses) with their sweeper.

The jobs run here rather than in the routers so that a router's event loop
stays for interactive traffic and holds no Temporal wait; their lines still
go through a router (``LLMGW_ROUTER_URLS``), whose admission queue is the
only place that sees the interactive requests a batch must yield to.
"""

import asyncio
import logging
import sys
from datetime import timedelta

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from activities.control.jobs import JobActivities
from activities.control.jobs_sweeper import Sweeper
from activities.control.replicas import ControlActivities
from activities.control.router_client import RouterClient
from llmgw import contracts
from llmgw import search_attributes as sa
from llmgw.engine_keys import EngineKeySource, engine_key
from llmgw.errors import ConfigError
from llmgw.lifecycle import setup_logging, stop_event_on_signals
from llmgw.queues import CONTROL_QUEUE, EXEC_QUEUE, FLEET_WORKFLOW_ID
from llmgw.settings import ControlSettings
from llmgw.store import Store
from llmgw.temporal import connect_with, metrics_runtime
from llmgw.tracing import setup_tracing
from llmgw.types import BatchRun, FleetSnapshot
from workflows.adapter_load import AdapterLoadWorkflow
from workflows.deployment import DeploymentWorkflow
from workflows.drain_node import DrainNodeWorkflow
from workflows.fleet import FleetWorkflow
from workflows.jobs_batch import BatchWorkflow
from workflows.jobs_response import BackgroundResponseWorkflow
from workflows.logs import ShardLogsWorkflow
from workflows.model_pull import ModelPullWorkflow
from workflows.reconcile import reconcile_forever
from workflows.rendezvous import RendezvousWorkflow
from workflows.replica import ReplicaWorkflow

log = logging.getLogger(__name__)
# On SIGTERM: the graceful period for running activities plus this for the
# worker's pollers to stop (all within shutdown_timeout_s).
WORKER_STOP_MARGIN_S = 1.0
# The exit status of a control worker refused by its configuration (sysexits' EX_CONFIG).
CONFIG_EXIT = 78

WORKFLOWS = [
    AdapterLoadWorkflow,
    DeploymentWorkflow,
    DrainNodeWorkflow,
    FleetWorkflow,
    ModelPullWorkflow,
    ReplicaWorkflow,
    RendezvousWorkflow,
    ShardLogsWorkflow,
]


async def ensure_fleet(client: Client) -> None:
    """Start the fleet entity unless it runs already."""
    await contracts.FLEET.start(
        client,
        FleetSnapshot(),
        id=FLEET_WORKFLOW_ID,
        task_queue=CONTROL_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


def engine_key_from(settings: ControlSettings) -> EngineKeySource:
    """Engine keys for probes, from the store's secret (read once, when first needed)."""
    secret: list[str] = []

    async def key_of(replica_id: str) -> str:
        if not secret:

            def read() -> str:
                store = Store(settings.resolved_store_url())
                try:
                    return store.engine_key_secret()
                finally:
                    store.close()

            secret.append(await asyncio.to_thread(read))
        return engine_key(secret[0], replica_id)

    return key_of


def build_worker(
    client: Client, settings: ControlSettings, task_queue: str = CONTROL_QUEUE
) -> Worker:
    """The control worker, built from its dependencies."""
    control = ControlActivities(client, engine_key_from(settings))
    return Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        activities=[
            control.place_replica,
            control.release_replica,
            control.validate_replica,
            control.fleet_cordon,
            control.probe_engine,
        ],
        sticky_queue_schedule_to_start_timeout=timedelta(
            seconds=settings.sticky_schedule_to_start_s
        ),
        graceful_shutdown_timeout=timedelta(seconds=settings.graceful_shutdown_s),
    )


def batch_defaults(settings: ControlSettings) -> BatchRun:
    """The knobs every batch's workflow starts with (id and expiry set per batch)."""
    return BatchRun(
        batch_id="",
        expires_at=0,
        chunk_lines=settings.batch_chunk_lines,
        parallel_chunks=settings.batch_parallel_chunks,
        line_concurrency=settings.batch_line_concurrency,
    )


def build_exec_worker(
    client: Client, settings: ControlSettings, store: Store, task_queue: str = EXEC_QUEUE
) -> tuple[Worker, RouterClient]:
    """The jobs' worker (and its router client, to close after it)."""
    secret: list[str] = []

    async def read_secret() -> str:
        if not secret:
            secret.append(await asyncio.to_thread(store.engine_key_secret))
        return secret[0]

    router = RouterClient(settings.router_url_list(), read_secret)
    jobs = JobActivities(store, router)
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[BatchWorkflow, BackgroundResponseWorkflow],
        activities=[
            jobs.validate_batch,
            jobs.set_batch_status,
            jobs.run_chunk,
            jobs.finalize_batch,
            jobs.run_response,
        ],
        sticky_queue_schedule_to_start_timeout=timedelta(
            seconds=settings.sticky_schedule_to_start_s
        ),
        graceful_shutdown_timeout=timedelta(seconds=settings.graceful_shutdown_s),
    )
    return worker, router


async def run(settings: ControlSettings) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully."""
    tracing = setup_tracing(settings.tracing, "control")
    runtime = metrics_runtime(settings.metrics_address) if settings.metrics_address else None
    client = await connect_with(settings, tracing.interceptors(), runtime=runtime)
    await sa.require_registered(client)
    await ensure_fleet(client)
    worker = build_worker(client, settings)
    log.info("control worker on %s (Temporal %s)", CONTROL_QUEUE, settings.temporal_address)
    store = Store(settings.resolved_store_url()) if settings.reconcile_catalog else None
    jobs_store = Store(settings.resolved_store_url())
    exec_worker, router = build_exec_worker(client, settings, jobs_store)
    sweeper = Sweeper(jobs_store, client, batch_defaults(settings))
    # Reconcile passes read through an untraced client (a trace every pass
    # would be noise); a pass that acts is a trace, its actions through
    # ``client`` part of it.
    reads = await connect_with(settings)
    stop = stop_event_on_signals(settings.shutdown_timeout_s)
    # The two workers run as tasks rather than nested ``async with`` blocks:
    # leaving those stops them one after the other, and once the bound below
    # cancels the first exit the second waits on a frozen server unbounded.
    runs = [asyncio.ensure_future(worker.run()), asyncio.ensure_future(exec_worker.run())]
    background: list[asyncio.Task[None]] = []
    if settings.reconcile_interval_s > 0:
        background.append(
            asyncio.ensure_future(
                reconcile_forever(reads, client, store, settings.reconcile_interval_s)
            )
        )
    if settings.job_sweep_interval_s > 0:
        background.append(asyncio.ensure_future(sweeper.forever(settings.job_sweep_interval_s)))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([stopped, *runs, *background], return_when=asyncio.FIRST_COMPLETED)
        log.info("control worker shutting down")
        for task in background:
            task.cancel()
        try:
            # The workers' stop waits on pollers that a frozen Temporal
            # server never answers: bounded, both at once.
            async with asyncio.timeout(settings.graceful_shutdown_s + WORKER_STOP_MARGIN_S):
                await asyncio.gather(worker.shutdown(), exec_worker.shutdown())
        except TimeoutError:
            log.warning("control worker did not stop in time; exiting anyway")
    finally:
        stopped.cancel()
        for task in [*runs, *background]:
            task.cancel()
        await asyncio.wait([stopped, *runs, *background], timeout=WORKER_STOP_MARGIN_S)
    # A worker or a loop that ended on its own (not by the stop) ends the
    # process with its error, after the cleanup below.
    ended = [t for t in [*runs, *background] if t.done() and not t.cancelled()]
    failed = next((e for e in (t.exception() for t in ended) if e is not None), None)
    await router.aclose()
    jobs_store.close()
    if store is not None:
        store.close()
    tracing.shutdown()
    if failed is not None:
        raise failed


def main() -> None:
    """Entry point of ``llmgw control``."""
    settings = ControlSettings()
    setup_logging(settings.log_level, "control")
    try:
        asyncio.run(run(settings))
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(CONFIG_EXIT)
