"""The node agent: serves this node's activities on ``node-<node_id>``.

On start it adopts the engines a previous agent left running, kills engines
nothing describes, registers its inventory (GPUs, fabric, running shards)
with the fleet, and then keeps re-registering; each round also stops engines
whose replica the control plane no longer runs.

The agent builds its services (``ShardService``, ``AdapterService``); the
Temporal activities over them come from the ``activities`` factory its caller
passes (``llmgw agent``: llmgw_cli/agent.py, with ``activities/agent/``), so
the imports point one way: that layer imports the agent, never back.
"""

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
from opentelemetry import trace
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError
from temporalio.worker import Worker

from llmgw import contracts
from llmgw.engine_keys import engine_key
from llmgw.lifecycle import setup_logging, stop_event_on_signals, unless_stopped
from llmgw.queues import CONTROL_QUEUE, FLEET_WORKFLOW_ID, node_queue, replica_workflow_id
from llmgw.settings import AgentSettings
from llmgw.store import Store
from llmgw.temporal import connect_with, workflow_running
from llmgw.tracing import setup_tracing
from llmgw.types import (
    FleetSnapshot,
    NodeInventory,
    NodeRef,
    ShardRef,
    ShardReport,
)
from worker_agent.adapter_service import AdapterService
from worker_agent.adoption import AdoptionReport, adopt
from worker_agent.fetch import ArtifactCache, FetchPolicy, peer_key
from worker_agent.installs.installed import EngineInstalls
from worker_agent.installs.llamacpp import (
    LlamaCppInstall,
    ensure_llama_cpp,
    relocated,
)
from worker_agent.installs.steps import EngineInstallError
from worker_agent.inventory import (
    Sources,
    collect,
    engine_capabilities,
    sources_from,
    weights_report,
)
from worker_agent.launch import Launcher
from worker_agent.liveness import LivenessRules
from worker_agent.origins import Origins
from worker_agent.peering import FleetPeers, NoPeers, ServedPeers, serve_peers
from worker_agent.remote_weights import PeerFinder, RemoteWeights
from worker_agent.shard_record import ShardRecord
from worker_agent.shard_service import ShardService
from worker_agent.supervisor import RunningShard, Supervisor
from worker_agent.system_dir import system_base
from worker_agent.system_users import SystemUsers
from worker_agent.terminal import detach_terminal
from worker_agent.users import (
    EngineIdentity,
    engine_identity,
    reachable,
    require_reach,
)
from worker_agent.weights import WeightsCache

log = logging.getLogger(__name__)
# Shutdown (all within shutdown_timeout_s): deregistering, and beside it the
# worker's graceful period for running activities plus this for its pollers.
DEREGISTER_TIMEOUT_S = 2.0
WORKER_STOP_MARGIN_S = 1.0


@dataclass(frozen=True)
class AgentServices:
    """What the agent serves on its node queue, for the Temporal layer to adapt."""

    shards: ShardService
    adapters: AdapterService


# The functions the worker registers as activities, made from the services.
ActivityFactory = Callable[[AgentServices], Sequence[Callable[..., object]]]


async def register(client: Client, inventory: NodeInventory) -> None:
    """Report this node to the fleet, starting the fleet if it is not running."""
    await contracts.REGISTER_NODE.send_with_start(
        client,
        contracts.FLEET,
        FleetSnapshot(),
        inventory,
        id=FLEET_WORKFLOW_ID,
        task_queue=CONTROL_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


def build_shards(
    settings: AgentSettings,
    secret: str,
    supervisor: Supervisor,
    installs: EngineInstalls,
    current_inventory: Callable[[], NodeInventory],
    engine_dir: Path | None = None,
    remote: RemoteWeights | None = None,
) -> ShardService:
    """The node's shard service with its real dependencies; the weights cache is in
    ``engine_dir`` (where the engine user reaches: EngineIdentity.engine_dir),
    by default the supervisor's directory."""
    return ShardService(
        Launcher(
            supervisor=supervisor,
            installs=installs,
            cpu_kv_cache_mib=settings.cpu_kv_cache_mib,
            engine_key=lambda replica_id: engine_key(secret, replica_id),
            engine_host=settings.engine_host,
            ports=range(settings.port_range_start, settings.port_range_end + 1),
            inventory=current_inventory,
            threads=settings.engine_threads,
            weights=WeightsCache(
                (engine_dir or supervisor.work_dir) / "weights",
                settings.resolved_weights_roots(),
                group=_engine_group(supervisor),
            ),
            remote=remote
            or remote_weights(settings, engine_dir or supervisor.work_dir, supervisor),
        ),
        liveness=LivenessRules(
            interval_s=settings.liveness_interval_s,
            timeout_s=settings.liveness_timeout_s,
            rounds=settings.liveness_unanswered_rounds,
            unanswered_s=settings.liveness_unanswered_s,
            stall_s=settings.liveness_stall_s,
        ),
    )


def remote_weights(
    settings: AgentSettings,
    engine_dir: Path,
    supervisor: Supervisor,
    find_peers: PeerFinder | None = None,
) -> RemoteWeights:
    """Pinned remote sources, fetched into ``engine_dir/artifacts`` (apart from the
    local sources' cache: its eviction must not weigh their entries), the peers
    ``find_peers`` names asked first."""
    cache = ArtifactCache(
        engine_dir / "artifacts",
        policy=FetchPolicy(stall_s=settings.fetch_stall_s),
        budget_bytes=settings.weights_cache_bytes or None,
        group=_engine_group(supervisor),
    )
    origins = Origins(
        settings.hf_endpoint,
        hf_token=settings.resolved_hf_token,
        storage_profiles=settings.resolved_storage_profiles(),  # a bad one fails the start
        modelscope_endpoint=settings.modelscope_endpoint,
        modelscope_token=settings.resolved_modelscope_token,
    )
    return RemoteWeights(cache, origins, find_peers)


def _engine_cache(
    settings: AgentSettings, identity: EngineIdentity, agent_dir: Path
) -> tuple[Path, LlamaCppInstall]:
    """Where engines are installed, and llama.cpp there (installed if needed).

    The configured cache, unless the engine user's home had to move to the
    system directory (a clone under a 0700 home, whose own .llmgw/engines
    ``llmgw up`` names) and the user cannot reach the llama.cpp install:
    then the engine cache is ``<system dir>/<digest of the work dir>/engines``.
    Where the user cannot reach what the install needs (the wheels sit in the
    venv, which ``make run`` makes in the clone), a copy goes to the engine
    cache (``relocated``); failing that, engines are refused (``require_reach``).
    """

    def progress(line: str) -> None:
        log.info("llama.cpp: %s", line)

    cache_dir = settings.resolved_engine_cache_dir()
    llama = ensure_llama_cpp(cache_dir, progress=progress)
    run_as, engine_dir, system_dir = identity.run_as, identity.engine_dir, settings.system_dir
    if run_as is None:
        return cache_dir, llama
    out = [p for p in llama.needs() if not reachable(p, run_as.uid, run_as.groups)]
    if out and system_dir is not None and engine_dir not in (None, agent_dir.resolve()):
        cache_dir = system_base(system_dir, settings.work_dir) / "engines"
    if out:
        log.info("engine cache: %s (the engine user cannot reach %s)", cache_dir, out[0])
        try:  # a copy there (the wheels sit in the venv, in the clone too)
            llama = relocated(
                llama, cache_dir, lambda p: reachable(p, run_as.uid, run_as.groups), progress
            )
        except EngineInstallError as exc:  # require_reach refuses, naming what is out of reach
            log.error("llama.cpp: %s", exc)
    return cache_dir, llama


def _engine_group(supervisor: Supervisor) -> int | None:
    """The group that may read the weights cache: the engine user's."""
    return supervisor.run_as.gid if supervisor.run_as is not None else None


def inventory(
    settings: AgentSettings,
    supervisor: Supervisor,
    sources: Sources,
    lost: Sequence[ShardRef] = (),
    installs: EngineInstalls | None = None,
) -> NodeInventory:
    """This node's inventory, with the shards it runs right now."""
    inv = collect(
        settings.node_id,
        settings.engine_host,
        sources,
        engine_pids=supervisor.engine_pids(),
        max_cpu_replicas=settings.max_cpu_replicas,
        management_address=settings.management_address,
    )
    inv.running = [report(r, supervisor.plan_of(r.ref)) for r in supervisor.running()]
    inv.lost = list(lost)
    inv.engines = installs.installed() if installs is not None else []
    inv.capabilities = engine_capabilities(installs.llama) if installs is not None else None
    inv.weights = weights_report(settings.resolved_weights_roots())
    inv.peer_url = settings.peer_url if settings.serve_peers else ""
    return inv


def report(shard: RunningShard, plan: ShardRecord) -> ShardReport:
    """A running shard as the fleet sees it: enough to rebuild its allocation."""
    return ShardReport(
        replica_id=shard.ref.replica_id,
        rank=shard.ref.rank,
        pid=shard.pid,
        endpoint=shard.endpoint,
        model=plan.model,
        gpu_indices=list(plan.gpu_indices),
        priority=plan.priority,
        catalog_digest=plan.catalog_digest,
    )


async def stop_orphans(client: Client, supervisor: Supervisor, grace_s: float) -> list[str]:
    """Stop engines whose replica workflow has ended or never existed."""
    stopped: list[str] = []
    for shard in supervisor.running():
        if await workflow_running(client, replica_workflow_id(shard.ref.replica_id)) is False:
            log.warning(
                "replica %s is not running in Temporal: stopping its engine", shard.ref.replica_id
            )
            await asyncio.to_thread(supervisor.stop, shard.ref, grace_s)
            stopped.append(shard.ref.replica_id)
    return stopped


async def _first_round(client: Client, supervisor: Supervisor, latest: NodeInventory) -> None:
    await stop_orphans(client, supervisor, grace_s=10)
    await register(client, latest)


async def deregister(client: Client, node_id: str, timeout_s: float) -> None:
    """Tell the fleet this node is leaving, giving up after ``timeout_s``: a
    shutdown must not wait on an unreachable Temporal (the client retries a
    refused connection for ~10 s and waits on a frozen server for 30 s), and
    the fleet notices a node that stopped registering anyway."""
    fleet = client.get_workflow_handle(FLEET_WORKFLOW_ID)
    try:
        async with asyncio.timeout(timeout_s):
            await contracts.DEREGISTER_NODE.send(
                fleet,
                NodeRef(node_id=node_id),
                rpc_timeout=timedelta(seconds=timeout_s),
            )
    except (RPCError, TimeoutError) as exc:
        log.warning("could not deregister within %g s: %s", timeout_s, exc or "timed out")


async def _keep_registered(
    client: Client,
    settings: AgentSettings,
    supervisor: Supervisor,
    sources: Sources,
    latest: list[NodeInventory],
    installs: EngineInstalls,
) -> None:
    while True:
        await asyncio.sleep(settings.register_interval_s)
        try:
            await stop_orphans(client, supervisor, grace_s=10)
            latest[0] = await asyncio.to_thread(
                inventory, settings, supervisor, sources, (), installs
            )
            await register(client, latest[0])
        except Exception as exc:  # keep serving; the next round retries
            log.warning("registration round failed: %s", exc)


def _adopted(settings: AgentSettings, supervisor: Supervisor) -> AdoptionReport:
    """What a restarted agent found and kept (traced, logged)."""
    with trace.get_tracer(__name__).start_as_current_span(
        "agent.adopt", attributes={"llmgw.node": settings.node_id}
    ) as span:
        report = adopt(supervisor)
        span.set_attributes(
            {
                "llmgw.adopted": [s.ref.replica_id for s in report.adopted],
                "llmgw.lost": [r.replica_id for r in report.lost],
                "llmgw.killed": len(report.killed),
            }
        )
    log.info(
        "agent %s: adopted %d engines, %d shards lost, %d unidentified engines killed",
        settings.node_id,
        len(report.adopted),
        len(report.lost),
        len(report.killed),
    )
    return report


@dataclass
class _Peering:
    """The node's remote weights, the peers it asks and the server it runs."""

    remote: RemoteWeights
    peers: FleetPeers
    served: ServedPeers | NoPeers


async def _peering(
    settings: AgentSettings, secret: str, engine_dir: Path, supervisor: Supervisor
) -> tuple[AgentSettings, _Peering]:
    """Remote weights in ``engine_dir``, peers found in the fleet, and the peer
    server over the cache (unless turned off); the settings with the URL it
    advertises (``peer_url``)."""
    peers = FleetPeers(settings.node_id, peer_key(secret))
    remote = remote_weights(settings, engine_dir, supervisor, peers.find)
    if not settings.serve_peers:
        return settings, _Peering(remote, peers, NoPeers())
    remote.cache.root.mkdir(parents=True, exist_ok=True)
    host = settings.management_address or settings.engine_host
    served = await serve_peers(
        remote.cache.root, peers.key, host, settings.peer_port, settings.peer_url
    )
    log.info("agent %s serves its weights to peers at %s", settings.node_id, served.url)
    return settings.model_copy(update={"peer_url": served.url}), _Peering(remote, peers, served)


async def run(settings: AgentSettings, activities: ActivityFactory) -> None:
    """Adopt, register, then serve the node queue until SIGTERM/SIGINT, with
    the activities ``activities`` makes from the agent's services."""
    store = Store(settings.resolved_store_url())
    store.migrate()
    secret = store.engine_key_secret()
    store.close()
    agent_dir = settings.work_dir / "agent" / settings.node_id
    identity = engine_identity(
        settings.engine_user,
        settings.work_dir,
        agent_dir,
        [],
        admin=SystemUsers(),
        allow_root=settings.allow_root_engines,
        system_dir=settings.system_dir,
    )
    cache_dir, llama = _engine_cache(settings, identity, agent_dir)
    identity = require_reach(identity, llama.needs())
    installs = EngineInstalls(cache_dir, llama)
    for found in installs.installed():
        log.info("engine %s: %s==%s at %s", found.engine, found.package, found.version, found.path)
    (log.error if identity.refusal else log.info)("agent %s: %s", settings.node_id, identity.why)
    supervisor = Supervisor(
        agent_dir,
        settings.node_id,
        identity.run_as,
        refusal=identity.refusal,
        allow_root=identity.allow_root,
        proxy=identity.proxy,
    )
    # Before adopt(): what a restarted agent found and kept is traced too.
    tracing = setup_tracing(settings.tracing, "agent")
    report = _adopted(settings, supervisor)
    sources = sources_from(settings.sys_root, settings.gpu_snapshot)
    settings, peering = await _peering(
        settings, secret, identity.engine_dir or supervisor.work_dir, supervisor
    )
    latest = [inventory(settings, supervisor, sources, report.lost, installs)]
    shards = build_shards(
        settings,
        secret,
        supervisor,
        installs,
        lambda: latest[0],
        identity.engine_dir,
        peering.remote,
    )
    adapter_http = httpx.AsyncClient(timeout=httpx.Timeout(60.0))
    adapters = AdapterService(
        supervisor,
        lambda replica_id: engine_key(secret, replica_id),
        adapter_http,
        settings.resolved_weights_roots(),
    )
    served = activities(AgentServices(shards=shards, adapters=adapters))
    # Registration rounds are not traced (a trace every 30 s per node is
    # noise); the node's activities are, as part of their caller's trace.
    client = await connect_with(settings)
    peering.peers.client = client
    queue = node_queue(settings.node_id)
    worker = Worker(
        client,
        task_queue=queue,
        interceptors=tracing.interceptors(),
        activities=served,
        max_concurrent_activities=64,
        graceful_shutdown_timeout=timedelta(seconds=settings.graceful_shutdown_s),
    )
    stop = stop_event_on_signals(settings.shutdown_timeout_s)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as stopping, worker:
            # Calls to a Temporal that does not answer are retried for a long
            # while: a SIGTERM meanwhile ends them.
            await unless_stopped(stop, _first_round(client, supervisor, latest[0]))
            if not stop.is_set():
                log.info("agent %s serving %s (pid %d)", settings.node_id, queue, os.getpid())
                keeper = asyncio.create_task(
                    _keep_registered(client, settings, supervisor, sources, latest, installs)
                )
                await stop.wait()
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper
            log.info("agent %s shutting down; engines keep running", settings.node_id)
            # Side by side with the worker's stop, each bounded: the stop
            # waits on pollers that a frozen Temporal server never answers.
            leaving = asyncio.create_task(
                deregister(client, settings.node_id, DEREGISTER_TIMEOUT_S)
            )
            stopping.reschedule(loop.time() + settings.graceful_shutdown_s + WORKER_STOP_MARGIN_S)
    except TimeoutError:
        if not stopping.expired():
            raise
        log.warning("agent %s: worker did not stop in time; exiting anyway", settings.node_id)
    await leaving
    await peering.served.stop()
    await shards.aclose()
    await adapter_http.aclose()
    tracing.shutdown()


def main(activities: ActivityFactory) -> None:
    """Run the agent until SIGTERM/SIGINT, serving the activities ``activities``
    makes (``llmgw agent``: llmgw_cli/agent.py)."""
    settings = AgentSettings()
    setup_logging(settings.log_level, "agent")
    # Before any engine is forked: they would inherit a root terminal.
    detach_terminal()
    asyncio.run(run(settings, activities))
