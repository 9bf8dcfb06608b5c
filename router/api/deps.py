"""What request handlers need, built once in ``create_app`` and passed down."""

from dataclasses import dataclass, field

from fastapi import Request
from opentelemetry.trace import Tracer
from temporalio.client import Client

from llmgw.catalog import DEFAULT_MAX_REPLICAS
from llmgw.engine_keys import EngineKeyFn
from llmgw.store import Store
from router.admission.queue import Admission
from router.affinity.affinity import Affinity
from router.api.auth import KeyVerifier
from router.billing.accounting import Accountant
from router.common.blocking import STORE_WAIT_S
from router.common.metrics import Metrics
from router.control_link.adapters import AdapterRouter
from router.control_link.routing import RoutingTable
from router.forwarding.proxy import Proxy
from router.responses.bounds import ResponseBounds


@dataclass
class Deps:
    """The router's dependencies."""

    table: RoutingTable
    keys: KeyVerifier
    proxy: Proxy
    accountant: Accountant
    metrics: Metrics
    store: Store
    engine_key: EngineKeyFn
    max_request_bytes: int
    adapters: AdapterRouter
    # Requests that wait for a replica (saturated, or scaled to zero).
    admission: Admission
    # Which replica holds which prompt prefix (router/affinity/): one per router.
    affinity: Affinity | None = None
    # Admin calls that ask Temporal (nodes, log tails); None in tests without one.
    temporal: Client | None = None
    # A span per request; None (tracing off): no span, no trace context
    # taken from the client or handed to the engine.
    tracer: Tracer | None = None
    # The longest an admin call waits for the store (LLMGW_STORE_WAIT_S).
    store_wait_s: float = STORE_WAIT_S
    # The most replicas a catalog entry or a scale call may ask of one model.
    max_replicas: int = DEFAULT_MAX_REPLICAS
    # The largest file /v1/files takes (LLMGW_MAX_FILE_BYTES).
    max_file_bytes: int = 200 * 1024 * 1024
    # What one key's files may hold in all (LLMGW_MAX_KEY_FILE_BYTES).
    max_key_file_bytes: int = 10 * 1024**3
    # What stored responses may hold (LLMGW_MAX_RESPONSE_BYTES, LLMGW_MAX_KEY_RESPONSE_BYTES).
    responses: ResponseBounds = field(default_factory=ResponseBounds)


async def get_deps(request: Request) -> Deps:
    """FastAPI dependency: the app's Deps.

    Async on purpose: FastAPI runs a plain ``def`` dependency in its thread
    pool, a thread hop on every request.
    """
    deps: Deps = request.app.state.deps
    return deps
