"""The router's Prometheus metrics, served at ``/metrics``.

One registry per app (tests build several apps in one process). In-flight
per replica is read off the routing table at scrape time rather than kept in
a gauge updated on every request.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class _Route(Protocol):
    @property
    def replica_id(self) -> str: ...
    @property
    def inflight(self) -> int: ...


class Routes(Protocol):
    """What the metrics read of the routing table (router/control_link/routing.py),
    at scrape time: the table sits above this module, so it is named by shape."""

    @property
    def routes(self) -> Mapping[str, Sequence[_Route]]: ...


# Every label comes from a bounded set: a route template, a catalog model
# (or a replica the table knows), an error table status, a fixed reason.
# Never from request text: prometheus keeps each series it ever saw. This
# stands for a route the request matched none of (never expected: keyed
# routes are matched before their key check).
OTHER_ROUTE = "other"

# Label sets of cached children (models x endpoints x statuses, normally a few dozen).
MAX_CACHED_CHILDREN = 10_000

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _InflightCollector(Collector):
    def __init__(self, table: Routes) -> None:
        self._table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "llmgw_replica_inflight", "requests in flight per replica", labels=["model", "replica"]
        )
        for model, routes in self._table.routes.items():
            for route in routes:
                inflight.add_metric([model, route.replica_id], route.inflight)
        yield inflight


class _QueueCollector(Collector):
    def __init__(self, depths: Callable[[], dict[str, int]]) -> None:
        self._depths = depths

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily(
            "llmgw_queue_waiting", "requests waiting in the admission queue", labels=["model"]
        )
        for model, depth in sorted(self._depths().items()):
            waiting.add_metric([model], depth)
        yield waiting


class Metrics:
    """Every metric the router exports."""

    def __init__(self, table: Routes) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llmgw_requests", "requests answered", ["endpoint", "model", "status"], registry=r
        )
        self.latency = Histogram(
            "llmgw_request_duration_seconds",
            "request start to last byte",
            ["endpoint", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llmgw_time_to_first_token_seconds",
            "streams: request start to the first byte relayed",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("llmgw_tokens", "tokens served", ["model", "kind"], registry=r)
        self.quota_rejections = Counter(
            "llmgw_quota_rejections", "requests refused by a quota", ["limit"], registry=r
        )
        self.upstream_errors = Counter(
            "llmgw_upstream_errors",
            "engine failures seen by the router",
            ["model", "replica", "kind"],
            registry=r,
        )
        self.coalesce_window = Gauge(
            "llmgw_stream_coalesce_window_seconds",
            "how long a relayed stream's events are held to go out together (0: not)",
            registry=r,
        )
        r.register(_InflightCollector(table))
        # Elastic serving (router/admission/queue.py, router/admission/wake.py).
        self.queue_wait = Histogram(
            "llmgw_queue_wait_seconds",
            "time a request waited in the admission queue (served or not)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_rejections = Counter(
            "llmgw_queue_rejections",
            "requests that left the admission queue unserved",
            ["model", "reason"],
            registry=r,
        )
        self.wakes = Counter(
            "llmgw_wakes", "wakes of a model scaled to zero", ["model", "result"], registry=r
        )
        # Cache-aware routing (router/affinity/): what the engines reported of
        # the requests' prompts, and why each replica was chosen. The hit
        # ratio is cached over prompt tokens.
        self.route_prompt_tokens = Counter(
            "llmgw_router_prompt_tokens",
            "prompt tokens of answered requests, per replica (engine-reported)",
            ["model", "replica"],
            registry=r,
        )
        self.route_cached_tokens = Counter(
            "llmgw_router_cached_tokens",
            "of those prompt tokens, the ones the engine took from its cache "
            "(usage.prompt_tokens_details.cached_tokens); hit ratio = cached / prompt",
            ["model", "replica"],
            registry=r,
        )
        self.route_predicted_tokens = Counter(
            "llmgw_router_prefix_predicted_tokens",
            "cached prompt tokens the router predicted for the replica it chose",
            ["model", "replica"],
            registry=r,
        )
        self.route_choices = Counter(
            "llmgw_router_route_choices",
            "replica choices by reason: prefix, sticky, rendezvous (cache affinity), "
            "balance (the best-cached replica was too busy), least_loaded, round_robin, session",
            ["model", "reason"],
            registry=r,
        )

        # Labelled children by their labels: ``labels()`` validates and locks
        # on every call, a cost on each request; a child, once made, is the
        # same object for good (nothing here removes label sets).
        self._children: dict[tuple[object, ...], Any] = {}

    def _child(self, key: tuple[object, ...], make: Callable[[], Any]) -> Any:
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= MAX_CACHED_CHILDREN:
                self._children.clear()  # only a cache: prometheus keeps the series
            child = self._children[key] = make()
        return child

    def request_done(
        self, endpoint: str, model: str, status: int, seconds: float, prompt: int, completion: int
    ) -> None:
        """Count a finished request: its status, duration and tokens."""
        self._child(
            ("r", endpoint, model, status),
            lambda: self.requests.labels(endpoint, model, str(status)),
        ).inc()
        self._child(("l", endpoint, model), lambda: self.latency.labels(endpoint, model)).observe(
            seconds
        )
        if prompt:
            self._child(("t", model, "p"), lambda: self.tokens.labels(model, "prompt")).inc(prompt)
        if completion:
            self._child(("t", model, "c"), lambda: self.tokens.labels(model, "completion")).inc(
                completion
            )

    def route_chosen(self, model: str, reason: str) -> None:
        """Count a replica choice made for ``reason``."""
        self._child(("rc", model, reason), lambda: self.route_choices.labels(model, reason)).inc()

    def route_served(
        self, model: str, replica: str, prompt: int, cached: int | None, predicted: int
    ) -> None:
        """Count what a replica's engine reported of a prompt (``cached`` None: it
        did not say) and what the router predicted it held."""
        if prompt:
            self._child(
                ("rp", model, replica), lambda: self.route_prompt_tokens.labels(model, replica)
            ).inc(prompt)
        if cached:
            self._child(
                ("rk", model, replica), lambda: self.route_cached_tokens.labels(model, replica)
            ).inc(cached)
        if predicted:
            self._child(
                ("rf", model, replica), lambda: self.route_predicted_tokens.labels(model, replica)
            ).inc(predicted)

    def watch_queues(self, depths: Callable[[], dict[str, int]]) -> None:
        """Export the admission queue's depth per model, read at scrape time."""
        self.registry.register(_QueueCollector(depths))

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)
