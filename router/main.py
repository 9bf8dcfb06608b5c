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
from router.routing import TemporalReplicaSource

log = logging.getLogger(__name__)


async def run(settings: RouterSettings) -> None:
    """Serve until uvicorn is told to stop (it handles SIGINT/SIGTERM)."""
    store = Store(settings.resolved_store_url())
    store.migrate()
    client = await connect(settings.temporal_address, settings.temporal_namespace)
    upstream = httpx.AsyncClient(
        timeout=httpx.Timeout(
            settings.upstream_read_timeout_s, connect=settings.upstream_connect_timeout_s
        )
    )
    app = create_app(
        store,
        TemporalReplicaSource(client),
        settings.refresh_interval_s,
        http=upstream,
        on_close=store.close,
        temporal=client,
        admin_key=settings.admin_key.get_secret_value(),
        key_cache_ttl_s=settings.key_cache_ttl_s,
        usage_flush_interval_s=settings.usage_flush_interval_s,
        max_request_bytes=settings.max_request_bytes,
    )
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower()
    )
    log.info("router on http://%s:%d", settings.host, settings.port)
    await uvicorn.Server(config).serve()


def main() -> None:
    """Run the router."""
    settings = RouterSettings()
    setup_logging(settings.log_level, "router")
    asyncio.run(run(settings))
