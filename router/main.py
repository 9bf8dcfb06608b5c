"""Entry point of ``llmgw router``: uvicorn serving ``create_app``."""

import asyncio
import logging

import httpx
import uvicorn

from llmgw.lifecycle import setup_logging
from llmgw.settings import RouterSettings
from llmgw.store import Store
from llmgw.temporal import connect
from router.app import create_app
from router.routing import ReplicaSource, TemporalReplicaSource

log = logging.getLogger(__name__)


def build(settings: RouterSettings, store: Store, source: ReplicaSource) -> uvicorn.Config:
    """The served app as ``llmgw router`` runs it (the benchmark serves the same)."""
    upstream = httpx.AsyncClient(
        timeout=httpx.Timeout(
            settings.upstream_read_timeout_s, connect=settings.upstream_connect_timeout_s
        ),
        # Keep every connection alive: httpx keeps only 20 by default, so past
        # 20 requests in flight each response closed one and the next request
        # paid a new TCP connection (and left a TIME_WAIT socket behind).
        limits=httpx.Limits(
            max_connections=settings.upstream_max_connections,
            max_keepalive_connections=settings.upstream_max_connections,
        ),
    )
    app = create_app(
        store,
        source,
        settings.refresh_interval_s,
        http=upstream,
        on_close=store.close,
    )
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower()
    )


async def run(settings: RouterSettings) -> None:
    """Serve until uvicorn is told to stop (it handles SIGINT/SIGTERM)."""
    store = Store(settings.resolved_store_url())
    store.migrate()
    client = await connect(settings.temporal_address, settings.temporal_namespace)
    config = build(settings, store, TemporalReplicaSource(client))
    log.info("router on http://%s:%d", settings.host, settings.port)
    await uvicorn.Server(config).serve()


def main() -> None:
    """Run the router."""
    settings = RouterSettings()
    setup_logging(settings.log_level, "router")
    asyncio.run(run(settings))
