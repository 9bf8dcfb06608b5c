"""Entry point of ``llmgw router``: uvicorn serving ``create_app``."""

import asyncio
import logging
from collections.abc import Coroutine
from types import FrameType
from typing import Any

import uvicorn
from opentelemetry.trace import Tracer
from temporalio.client import Client

from llmgw.engine_keys import engine_key
from llmgw.lifecycle import ShutdownWatchdog, setup_logging
from llmgw.listener import ListenerLimits, fit_open_files, limited_protocol
from llmgw.settings import RouterSettings
from llmgw.store import Store
from llmgw.temporal import connect_with
from llmgw.tracing import setup_tracing
from router.affinity.affinity import Affinity
from router.affinity.slots import SlotShare
from router.app import create_app, make_upstream
from router.billing.usage_spool import UsageSpool, spool_dir
from router.control_link.endpoint_proof import HttpProver, ProvenSource
from router.control_link.replica_source import TemporalReplicaSource
from router.control_link.routing import ReplicaSource
from router.responses.bounds import ResponseBounds

log = logging.getLogger(__name__)
# Of shutdown_timeout_s, what is kept for the lifespan's shutdown (the last
# usage flush, closing the store) after open requests.
LIFESPAN_SHUTDOWN_RESERVE_S = 3.0


def build(
    settings: RouterSettings,
    store: Store,
    source: ReplicaSource,
    temporal: Client | None = None,
    tracer: Tracer | None = None,
) -> uvicorn.Config:
    """The served app as ``llmgw router`` runs it (the benchmark serves the same).

    ``temporal`` serves the admin calls that ask it (nodes, log tails).
    """
    upstream = make_upstream(
        settings.upstream_client,
        connect_timeout_s=settings.upstream_connect_timeout_s,
        read_timeout_s=settings.upstream_read_timeout_s,
        max_connections=settings.upstream_max_connections,
        dead_peer_s=settings.upstream_dead_peer_s,
    )
    app = create_app(
        store,
        source,
        settings.refresh_interval_s,
        http=upstream,
        on_close=store.close,
        temporal=temporal,
        admin_key=settings.admin_key.get_secret_value(),
        key_cache_ttl_s=settings.key_cache_ttl_s,
        store_wait_s=settings.store_wait_s,
        key_stale_s=settings.key_stale_s,
        usage_flush_interval_s=settings.usage_flush_interval_s,
        max_request_bytes=settings.max_request_bytes,
        stream_coalesce_max_s=settings.stream_coalesce_max_s,
        usage_spool=UsageSpool(
            spool_dir(settings.resolved_usage_spool_dir(), settings.resolved_store_url()),
            settings.router_id,
        ),
        tracer=tracer,
        router_id=settings.router_id,
        max_replicas=settings.max_replicas_per_model,
        max_file_bytes=settings.max_file_bytes,
        max_key_file_bytes=settings.max_key_file_bytes,
        response_bounds=ResponseBounds(
            settings.max_response_bytes, settings.max_key_response_bytes
        ),
        affinity=Affinity(slot_share=SlotShare(settings.slot_share, settings.slot_shares)),
        expose_replica_header=settings.expose_replica_header,
    )
    limits = fit_open_files(
        ListenerLimits(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            max_connections=settings.max_connections,
            max_connections_per_client=settings.max_connections_per_client,
            max_header_bytes=settings.max_header_bytes,
        ),
        other_fds=settings.upstream_max_connections,
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        # Slow and idle clients, and how many may be connected (llmgw/listener.py).
        http=limited_protocol(limits),
        timeout_keep_alive=limits.keepalive_timeout_s,
    )


async def serve(
    settings: RouterSettings,
    store: Store,
    source: ReplicaSource,
    temporal: Client | None = None,
    tracer: Tracer | None = None,
) -> None:
    """Serve until uvicorn is told to stop (it handles SIGINT/SIGTERM)."""
    config = build(settings, store, source, temporal, tracer)
    if config.timeout_graceful_shutdown is None:
        # Open requests (a stream may run for minutes) get what the bound
        # leaves after the lifespan's last usage flush; then they are cut.
        config.timeout_graceful_shutdown = max(
            1, int(settings.shutdown_timeout_s - LIFESPAN_SHUTDOWN_RESERVE_S)
        )
    log.info("router on http://%s:%d", settings.host, settings.port)
    await _Server(config, ShutdownWatchdog(settings.shutdown_timeout_s)).serve()


class _Server(uvicorn.Server):
    """uvicorn's server, whose SIGTERM/SIGINT also arms the shutdown watchdog:
    the lifespan's shutdown flushes usage to a store that may not answer."""

    def __init__(self, config: uvicorn.Config, watchdog: ShutdownWatchdog) -> None:
        super().__init__(config)
        self._watchdog = watchdog

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start the watchdog, then uvicorn's own graceful exit."""
        self._watchdog.arm()
        super().handle_exit(sig, frame)


async def run(settings: RouterSettings) -> None:
    """The router with its routing table read off Temporal."""
    store = Store(settings.resolved_store_url())
    store.migrate()
    tracing = setup_tracing(settings.tracing, "router")
    tracer = tracing.provider.get_tracer("llmgw.router") if tracing.provider else None
    # The routing table's refresh is not traced (a trace a second is noise).
    client = await connect_with(settings)
    secret = store.engine_key_secret()
    # Whoever can start a workflow can write a Replica memo: only endpoints
    # that prove they hold the replica's key are routed to.
    source = ProvenSource(
        TemporalReplicaSource(client, full_resync_s=settings.full_resync_s),
        HttpProver(lambda replica_id: engine_key(secret, replica_id)),
    )
    try:
        await serve(
            settings,
            store,
            source,
            client,
            tracer,
        )
    finally:
        await source.aclose()  # no proof outlives the router
        tracing.shutdown()


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run``, on uvloop where it is installed.

    ``Server.serve`` runs on whatever loop it is given (only uvicorn's own
    ``run`` picks uvloop), and uvloop roughly halves the router's CPU per
    request (tests/bench/bench_router.py).
    """
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def main() -> None:
    """Run the router."""
    settings = RouterSettings()
    setup_logging(settings.log_level, "router")
    run_loop(run(settings))
