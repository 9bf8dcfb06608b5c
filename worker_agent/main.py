"""The node agent: serves this node's activities on ``node-<node_id>``."""

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from datetime import timedelta

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from activities.node import NodeActivities
from llmgw.engine_install import ensure_llama_cpp
from llmgw.keys import engine_key
from llmgw.lifecycle import setup_logging, stop_event_on_signals
from llmgw.queues import CONTROL_QUEUE, FLEET_WORKFLOW_ID, node_queue
from llmgw.settings import AgentSettings
from llmgw.store import Store
from llmgw.temporal import connect
from llmgw.types import EngineKind, FleetSnapshot, NodeInventory
from worker_agent.engines import AdapterRegistry, LlamaCppAdapter
from worker_agent.inventory import NvmlProbe, collect
from worker_agent.supervisor import Supervisor

log = logging.getLogger(__name__)


async def register(client: Client, inventory: NodeInventory) -> None:
    """Report this node to the fleet, starting the fleet if it is not running."""
    await client.start_workflow(
        "Fleet",
        FleetSnapshot(),
        id=FLEET_WORKFLOW_ID,
        task_queue=CONTROL_QUEUE,
        start_signal="register_node",
        start_signal_args=[inventory],
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


def build_activities(settings: AgentSettings, secret: str) -> NodeActivities:
    """The node's activities with their real dependencies."""
    llama = ensure_llama_cpp(
        settings.resolved_engine_cache_dir(), progress=lambda line: log.info("llama.cpp: %s", line)
    )

    def env_for(base: Mapping[str, str]) -> dict[str, str]:
        return llama.environment(base)

    adapters = AdapterRegistry({EngineKind.LLAMA_CPP: LlamaCppAdapter(llama.server, env_for)})
    return NodeActivities(
        supervisor=Supervisor(settings.work_dir / "agent" / settings.node_id),
        adapters=adapters,
        engine_key=lambda replica_id: engine_key(secret, replica_id),
        engine_host=settings.engine_host,
        ports=range(settings.port_range_start, settings.port_range_end + 1),
        threads=settings.engine_threads,
    )


async def _keep_registered(client: Client, inventory: NodeInventory, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await register(client, inventory)
        except Exception as exc:  # keep serving; the next round retries
            log.warning("re-registration failed: %s", exc)


async def run(settings: AgentSettings) -> None:
    """Register, then serve the node queue until SIGTERM/SIGINT."""
    store = Store(settings.resolved_store_url())
    store.migrate()
    secret = store.engine_key_secret()
    store.close()
    node_activities = build_activities(settings, secret)
    client = await connect(settings.temporal_address, settings.temporal_namespace)
    inventory = collect(
        settings.node_id, settings.engine_host, NvmlProbe(), settings.max_cpu_replicas
    )
    queue = node_queue(settings.node_id)
    worker = Worker(
        client,
        task_queue=queue,
        activities=[
            node_activities.launch_shard,
            node_activities.wait_shard_ready,
            node_activities.watch_shard,
            node_activities.stop_shard,
        ],
        max_concurrent_activities=64,
        graceful_shutdown_timeout=timedelta(seconds=settings.graceful_shutdown_s),
    )
    stop = stop_event_on_signals()
    async with worker:
        await register(client, inventory)
        log.info("agent %s serving %s (pid %d)", settings.node_id, queue, os.getpid())
        keeper = asyncio.create_task(
            _keep_registered(client, inventory, settings.register_interval_s)
        )
        await stop.wait()
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        log.info("agent %s shutting down; engines keep running", settings.node_id)


def main() -> None:
    """Entry point of ``llmgw agent``."""
    settings = AgentSettings()
    setup_logging(settings.log_level, "agent")
    asyncio.run(run(settings))
