"""The router application: built by ``create_app`` from its dependencies."""

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any

from fastapi import FastAPI, Header
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from opentelemetry.trace import Tracer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send
from temporalio.client import Client

from llmgw.catalog import DEFAULT_MAX_REPLICAS
from llmgw.engine_keys import engine_key
from llmgw.store import Store
from llmgw.store.catalog_store import all_specs
from router.admission.queue import Admission
from router.affinity.affinity import Affinity
from router.affinity.scope import cache_salt
from router.affinity.slots import STUCK_S
from router.api import admin, batches, engine_metrics, openai, openapi_docs, responses
from router.api.auth import KeyVerifier
from router.api.deps import Deps
from router.api.files import router as files_api
from router.billing.accounting import Accountant
from router.billing.usage_spool import UsageSpool
from router.common.blocking import STORE_WAIT_S
from router.common.error_handlers import install_handlers
from router.common.metrics import Metrics
from router.control_link.adapters import AdapterLoader, AdapterRouter, TemporalAdapterLoader
from router.control_link.deployment_link import DeploymentLink, TemporalDeploymentLink
from router.control_link.endpoint_proof import ProvenSource
from router.control_link.jobs import JobLink, aclose_jobs, default_jobs
from router.control_link.load_report import REPORT_INTERVAL_S, LoadReporter
from router.control_link.routing import ReplicaSource, RoutingTable, refresh_forever
from router.forwarding.health import EngineProbe, HttpProbe, probe_forever
from router.forwarding.pacing import MAX_WINDOW_S, Pacer
from router.forwarding.proxy import Proxy
from router.forwarding.upstream import AiohttpUpstream, Upstream
from router.forwarding.upstream_raw import DEAD_PEER_S, RawUpstream
from router.responses.bounds import ResponseBounds

MiB = 1024 * 1024


class RouterApp(FastAPI):
    """FastAPI, except that a POST to an inference path goes straight to its
    plain ASGI endpoint: no middleware, no route matching (the hot path).
    Anything else (another method, a trailing slash, a mounted root path)
    takes FastAPI's way, where the same endpoints are routes too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct: dict[str, ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.direct.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def make_upstream(
    kind: str = "raw",
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 600.0,
    max_connections: int = 1024,
    dead_peer_s: float = DEAD_PEER_S,
) -> Upstream:
    """The engine client: ``raw`` (the default) or ``aiohttp`` (kept for one
    release; it waits out the read timeout on a host that vanished)."""
    if kind not in ("raw", "aiohttp"):
        raise ValueError(f"unknown upstream client {kind!r}")
    if kind == "aiohttp":
        return AiohttpUpstream(connect_timeout_s, read_timeout_s, max_connections)
    return RawUpstream(connect_timeout_s, read_timeout_s, max_connections, dead_peer_s=dead_peer_s)


def _elastic(
    table: RoutingTable,
    metrics: Metrics,
    temporal: Client | None,
    link: DeploymentLink | None,
    router_id: str,
    report_interval_s: float,
) -> tuple[Admission, LoadReporter | None]:
    """The admission queue, and the load reporter when there is a deployment link."""
    if link is None and temporal is not None:
        link = TemporalDeploymentLink(temporal)
    router_id = router_id or f"{socket.gethostname()}-{os.getpid()}"
    admission = Admission(table, metrics, link, router_id)
    table.on_update.append(admission.table_changed)
    if link is None:
        return admission, None
    reporter = LoadReporter(
        table, admission.counter, admission.waiting, link, router_id, report_interval_s
    )
    return admission, reporter


def _affinity(table: RoutingTable, affinity: Affinity | None) -> Affinity:
    """The router's cache affinity (one per process), told of every replica
    that leaves the table or changes its endpoint (it held nothing we knew),
    and asked each model's in-flight cap per replica (its pinned slots)."""
    affinity = affinity if affinity is not None else Affinity()
    table.on_forget.append(affinity.forget)
    table.cap_of = affinity.inflight_cap
    return affinity


def _include_apis(app: FastAPI) -> None:
    """The APIs served as FastAPI routes (OpenAI's, Responses, Batches, admin, engine metrics)."""
    apis = (openai.router, responses.routes, batches.routes, admin.router, engine_metrics.router)
    for api in (*apis, files_api):
        app.include_router(api)


def create_app(
    store: Store,
    source: ReplicaSource,
    refresh_interval_s: float = 1.0,
    http: Upstream | None = None,
    on_close: Callable[[], object] | None = None,
    *,
    temporal: Client | None = None,
    admin_key: str = "",
    key_cache_ttl_s: float = 5.0,
    store_wait_s: float = STORE_WAIT_S,
    key_stale_s: float = 3600.0,
    usage_flush_interval_s: float = 1.0,
    max_request_bytes: int = 8 * MiB,
    stream_coalesce_max_s: float = MAX_WINDOW_S,
    usage_spool: UsageSpool | None = None,
    clock: Callable[[], float] = time.time,
    tracer: Tracer | None = None,
    adapter_loader: AdapterLoader | None = None,
    probe: EngineProbe | None = None,
    deployment_link: DeploymentLink | None = None,
    router_id: str = "",
    load_report_interval_s: float = REPORT_INTERVAL_S,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    max_file_bytes: int = 200 * MiB,
    max_key_file_bytes: int = 10 * 1024 * MiB,
    response_bounds: ResponseBounds | None = None,
    jobs: JobLink | None = None,
    affinity: Affinity | None = None,
    slot_stuck_s: float = STUCK_S,
    expose_replica_header: bool = False,
) -> FastAPI:
    """The FastAPI app; the routing table refreshes and usage is flushed while it runs.

    ``adapter_loader`` loads on-demand LoRA adapters (default: the AdapterLoad
    workflow through ``temporal``; without either, such requests get 503).
    ``deployment_link`` carries load reports and wakes to the deployments
    (default: through ``temporal``; without either, a model scaled to zero
    cannot be woken and no load is reported).
    ``affinity`` is where this router remembers which replica holds which
    prompt prefix (default: a new one; one per router process).
    ``slot_stuck_s`` bounds a stream pinned to a llama.cpp slot until its
    first byte (router.forwarding.proxy.SlotStuck).
    ``expose_replica_header``: answers name the replica that served them
    (``x-llmgw-replica``; tests and benchmarks; off, a tenant learns nothing
    of where its requests, or another's, went).
    """
    if adapter_loader is None and temporal is not None:
        adapter_loader = TemporalAdapterLoader(temporal)
    secret = store.engine_key_secret()
    table = RoutingTable()
    client = http or make_upstream()
    ready = asyncio.Event()
    metrics = Metrics(table)
    pacer = Pacer(stream_coalesce_max_s, on_change=metrics.coalesce_window.set)
    accountant = Accountant(store, usage_flush_interval_s, clock, store_wait_s, usage_spool)

    def key_of(replica_id: str) -> str:
        return engine_key(secret, replica_id)

    # Endpoint proofs (router/control_link/endpoint_proof.py): a failed connection drops
    # one, and the lost-node probe proves an endpoint before it sends a key.
    proofs = source if isinstance(source, ProvenSource) else None
    prober = probe or HttpProbe(key_of, prove=proofs.check if proofs else None)
    admission, reporter = _elastic(
        table, metrics, temporal, deployment_link, router_id, load_report_interval_s
    )
    affinity = _affinity(table, affinity)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await accountant.open()
        tasks = [
            asyncio.create_task(
                refresh_forever(
                    table, source, lambda: all_specs(store), refresh_interval_s, ready, store_wait_s
                )
            ),
            asyncio.create_task(accountant.run()),
            asyncio.create_task(probe_forever(table, prober)),
            asyncio.create_task(admission.run()),
            asyncio.create_task(pacer.run()),
        ]
        if reporter is not None:
            tasks.append(asyncio.create_task(reporter.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await asyncio.gather(admission.aclose(), aclose_jobs(jobs))
            await accountant.flush()
            await accountant.close()
            await client.aclose()
            await prober.aclose()
            if on_close:
                on_close()

    app = RouterApp(
        title="llmgw router",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible gateway (`/v1`) and admin API (`/admin`).",
    )
    # Starts and cancels of batches and background responses (fire and forget).
    app.state.jobs = jobs = jobs or default_jobs(temporal, store)
    app.state.deps = Deps(
        table=table,
        keys=KeyVerifier(
            store, key_cache_ttl_s, admin_key, store_wait_s, key_stale_s, exec_secret=secret
        ),
        # One record of hidden reasons (router/common/errors.py), served by /admin/errors.
        proxy=Proxy(
            client,
            table,
            key_of,
            metrics,
            pacer,
            incidents=admission.incidents,
            on_unreachable=proofs.distrust if proofs else None,
            affinity=affinity,
            stuck_s=slot_stuck_s,
            # Engine cache salts per scope, from the one secret every router holds.
            salt_of=partial(cache_salt, secret),
            expose_replica=expose_replica_header,
        ),
        accountant=accountant,
        metrics=metrics,
        store=store,
        engine_key=key_of,
        max_request_bytes=max_request_bytes,
        adapters=AdapterRouter(table, adapter_loader),
        admission=admission,
        affinity=affinity,
        temporal=temporal,
        tracer=tracer,
        store_wait_s=store_wait_s,
        max_replicas=max_replicas,
        max_file_bytes=max_file_bytes,
        max_key_file_bytes=max_key_file_bytes,
        responses=response_bounds or ResponseBounds(),
    )
    install_handlers(app)
    for route in openai.inference_routes():
        app.router.routes.append(route)
        app.direct[route.path] = route.endpoint
    _include_apis(app)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, object]:
        return {"ok": True, "routing_table_loaded": ready.is_set()}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus(
        authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
    ) -> Response:
        # Behind the admin credential, as /admin is: the metrics name every
        # model and replica, which no client key may list. Prometheus sends
        # it as a bearer token (scrape config: authorization.credentials).
        # The router's own metrics; an engine's /metrics is never reachable here.
        await app.state.deps.keys.verify_admin(authorization)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        # FastAPI documents its own routes; the inference routes are plain
        # Starlette ones (router/api/openai.py says why) and bring their entries;
        # then what our error handlers answer instead of FastAPI's (openapi_docs).
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schema["paths"] = {
                **openapi_docs.inference_openapi(openai.INFERENCE),
                **schema["paths"],
            }
            app.openapi_schema = openapi_docs.truthful(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
