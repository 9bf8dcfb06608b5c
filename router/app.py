"""The router application: built by ``create_app`` from its dependencies."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from llmgw.keys import engine_key
from llmgw.store import Store
from router.api import openai
from router.auth import KeyVerifier
from router.deps import Deps
from router.errors import install_handlers
from router.proxy import Proxy
from router.routing import ReplicaSource, RoutingTable, refresh_forever


def create_app(
    store: Store,
    source: ReplicaSource,
    refresh_interval_s: float = 1.0,
    http: httpx.AsyncClient | None = None,
    on_close: Callable[[], object] | None = None,
) -> FastAPI:
    """The FastAPI app; the routing table refreshes while it runs."""
    secret = store.engine_key_secret()
    table = RoutingTable()
    client = http or httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
    ready = asyncio.Event()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(
            refresh_forever(
                table, source, lambda: set(store.model_names()), refresh_interval_s, ready
            )
        )
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.aclose()
            if on_close:
                on_close()

    app = FastAPI(title="llmgw router", version="0.1.0", lifespan=lifespan)
    app.state.deps = Deps(
        table=table,
        keys=KeyVerifier(store),
        proxy=Proxy(client, table, lambda replica_id: engine_key(secret, replica_id)),
    )
    install_handlers(app)
    app.include_router(openai.router)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, object]:
        return {"ok": True, "routing_table_loaded": ready.is_set()}

    return app
