"""One request on its way to an engine: what the proxy, the admission queue
and the waiting stream pass between them (router/forwarding/proxy.py sends
it; router/admission/ decides when)."""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmgw.types import ModelSpec
from router.affinity.chunks import PromptKey
from router.billing.bill import Bill
from router.control_link.routing import Route


@dataclass
class Call:
    """One request to forward."""

    model: str
    path: str
    body: bytes
    stream: bool
    # True when the router added include_usage and the client must not see it.
    strip_usage: bool
    # Settled once when the request is over (also after a client disconnect);
    # holds the prompt estimate and the reservation billed when the engine's
    # usage cannot be known (router/billing/bill.py).
    bill: Bill
    started: float
    # The engine generates on after the client leaves (llama.cpp finishes a
    # non-streamed request regardless): its answer is awaited anyway, to bill
    # what it generated, and the replica counts as busy until then.
    finishes_when_gone: bool = False
    # Returns when the client has disconnected (None: never watched).
    client_gone: Callable[[], Awaitable[None]] | None = None
    # The body for a given replica (a llama.cpp adapter's id is the replica's own).
    body_for: Callable[[Route], bytes] | None = None
    # An on-demand adapter the router believes the replica holds: a 404 means
    # its view is stale (another router unloaded it), raised as StaleAdapter.
    stale_on_404: bool = False
    # False with tracing off: no span to name the replica on, no trace
    # context to hand the engine (saves the propagators' work per request).
    traced: bool = True
    # The prompt's chunk chain and sticky key, for cache-aware routing
    # (router/affinity/); None: no affinity (embeddings, token-id prompts, a
    # least-loaded model, or one with a single route and no pinned slots).
    prompt_key: PromptKey | None = None
    # The catalog entry it was admitted under (an adapter's: its base model's;
    # None: a model outside the catalog, routed by the defaults): the proxy
    # orders the replicas by its routing without looking it up again.
    spec: ModelSpec | None = None
    # Whose cached prefixes it may share (router/affinity/scope.py): "" every
    # caller's (cache_scope shared), else its key's. Engines that salt get the
    # scope's salt; on one that cannot, the caller is told no cached tokens.
    cache_scope: str = ""
