"""Forwarding a request to a replica's engine, streamed or not.

The client's body goes upstream byte for byte (unknown fields included),
except that a stream always asks the engine for usage
(``stream_options.include_usage``) so it can be billed; the engine's answer
comes back byte for byte, SSE events included, less that usage when the
client did not ask for it. The client's Authorization never reaches the
engine: the router sends the replica's own engine key instead.

Failover: a connection failure before anything was sent to the client tries
the next replica, and so does a host that stopped answering before a byte
of its answer came (UpstreamHostGone: a partition, a power loss; found by TCP
keepalive and user timeout, LLMGW_UPSTREAM_DEAD_PEER_S); once a byte has gone
out there is no retry.

A stream is relayed read by read (with RawUpstream, from the engine
connection's read callback: router.forwarding.relay.Pour; while the event loop is
busy, reads are spaced out so that each brings several events:
router.forwarding.pacing): a read that holds no usage passes through untouched, its
content chunks counted by a byte pattern (no per-event work); only the
event carrying usage is parsed. A client that goes away
mid-stream cancels the relay (router.forwarding.relay watches); closing the upstream
response closes the connection, which llama.cpp and vLLM take as a
cancellation. What was relayed until then is billed: one token per streamed
chunk with content (exact for llama.cpp, which sends a chunk per token), or
the engine's own usage when the stream got that far.

Cache scopes (router/affinity/scope.py): a request of a scope other than
``shared`` goes to vLLM or SGLang with the scope's ``cache_salt`` (the
router's, never the client's: router/api/openai.py refuses one), and from
llama.cpp, whose cache every scope shares, its answer comes back with no
cached-token count nor timings (router/forwarding/cache_report.py). Which
replica served is said in ``x-llmgw-replica`` only when the router is set
to (``LLMGW_EXPOSE_REPLICA_HEADER``: tests, benchmarks): that name told a
tenant whose replica it reached, one half of the cache probe.

Where a model's request goes among its replicas is cache-aware
(router/affinity/): the ``Affinity`` orders the candidates the routing table
gives (ready, unsaturated, least loaded first) by the prompt prefix each is
believed to hold, and learns from each answer what the engine served and took
from its cache (``usage.prompt_tokens_details.cached_tokens``). An adapter's
requests go where the adapter is held, as before. Admission is not its
business: the queue decided that this request goes now, affinity only where.
"""

import asyncio
import errno
import logging
from collections.abc import Callable
from functools import partial

import aiohttp
from opentelemetry import trace
from opentelemetry.propagate import inject

from llmgw.engine_keys import EngineKeyFn
from llmgw.errors import LlmgwError, UpstreamConnectError, UpstreamError
from router.affinity.affinity import Affinity
from router.affinity.policy import Choice, Reason
from router.affinity.scope import SALT_FIELD, hides_cached, salts
from router.affinity.slots import ANY_SLOT, STUCK_S, with_field, with_slot
from router.billing.accounting import RequestOutcome
from router.common.disconnect import cancelled_if_gone
from router.common.errors import ErrorKind, Incidents, engine_failed
from router.common.metrics import Metrics
from router.control_link.routing import Route, RoutingTable
from router.forwarding.cache_report import hidden
from router.forwarding.call import Call
from router.forwarding.engine_stream import Relay, Usage, outcome_of
from router.forwarding.pacing import Pacer
from router.forwarding.relay import Reply, StreamReply, media_header
from router.forwarding.slot_priming import SlotPrimer
from router.forwarding.upstream import IDENTITY, Upstream, UpstreamResponse

__all__ = ["Call", "Proxy", "SlotStuck", "StaleAdapter"]

log = logging.getLogger(__name__)

# Passive health: how long an engine that refused a connection is passed
# over while another replica can serve (router.forwarding.health probes the lost ones).
PASSIVE_EJECT_S = 5.0
# Engine headers kept per replica id (cleared past this: replicas come and go).
MAX_CACHED_REPLICAS = 10_000
# Cache salts kept per scope (cleared past this: one HMAC each to redo).
MAX_CACHED_SALTS = 100_000
REPLICA_HEADER = b"x-llmgw-replica"


class SlotStuck(LlmgwError):
    """A streamed request pinned to a llama.cpp slot had no first byte after
    ``stuck_s``: the slot serves something else that does not end (another
    router's request, or a task the engine never finishes: seen twice in
    bench_prefix with two routers). Nothing was relayed or billed; the
    request was cancelled (the engine drops it with the connection) and goes
    once more, its slot now left out (router/affinity/slots.py)."""

    def __init__(self, route: Route, slot: int) -> None:
        super().__init__(f"{route.replica_id} slot {slot}")
        self.route = route


class StaleAdapter(LlmgwError):
    """The engine does not hold the adapter the router sent it: nothing was
    relayed or billed; the caller loads the adapter and forwards once more."""

    def __init__(self, route: Route) -> None:
        super().__init__(route.replica_id)
        self.route = route


class Proxy:
    """Sends inference requests to engines."""

    def __init__(
        self,
        http: Upstream,
        table: RoutingTable,
        engine_key: EngineKeyFn,
        metrics: Metrics,
        pacer: Pacer | None = None,
        incidents: Incidents | None = None,
        on_unreachable: Callable[[str, str], None] | None = None,
        affinity: Affinity | None = None,
        primer: SlotPrimer | None = None,
        stuck_s: float = STUCK_S,
        salt_of: Callable[[str], str] | None = None,
        expose_replica: bool = False,
    ) -> None:
        self._http = http
        # A cache scope's engine salt (router/affinity/scope.py cache_salt
        # under the router's secret); None: no salts (tests of other things).
        self._salt_of = salt_of
        self._salts: dict[str, bytes] = {}
        # Whether answers name their replica (x-llmgw-replica).
        self._expose_replica = expose_replica
        # How long a pinned stream waits for its first byte (SlotStuck).
        self._stuck_s = stuck_s
        # Copies a pinned llama.cpp slot's system prompt into another (slots).
        self._primer = primer or SlotPrimer(http)
        # Orders a model's replicas by the prompt prefix they hold (None: the
        # table's least-loaded order, as before).
        self._affinity = affinity
        # Told (replica id, endpoint) of a connection that failed or was
        # reset: its endpoint proof is dropped (router/control_link/endpoint_proof.py).
        self._on_unreachable = on_unreachable
        # Why a request failed, for admins: the client gets the error id only.
        self.incidents = incidents or Incidents()
        self._table = table
        self._engine_key = engine_key
        self._metrics = metrics
        self._pacer = pacer  # coalesces relayed reads while the loop is busy
        # The engine key is a MAC of the replica id: computed once per replica.
        self._headers: dict[str, dict[str, str]] = {}

    def _engine_headers(self, replica_id: str) -> dict[str, str]:
        headers = self._headers.get(replica_id)
        if headers is None:
            if len(self._headers) >= MAX_CACHED_REPLICAS:
                self._headers.clear()  # bounded under replica churn
            headers = {
                "Authorization": f"Bearer {self._engine_key(replica_id)}",
                "Content-Type": "application/json",
                # An engine is an untrusted byte source: its answers come
                # uncompressed (an encoded one is refused, upstream.py), so
                # that no bomb of its is ever expanded here. Absent, any
                # coding would be acceptable to it.
                "Accept-Encoding": IDENTITY,
            }
            self._headers[replica_id] = headers
        return headers

    async def forward(self, call: Call, routes: list[Route] | None = None) -> Reply | StreamReply:
        """Send the call to the ready replica of its model that the routing
        policy puts first (least busy, or holding the prompt's prefix), or to
        one of ``routes``, chosen by the caller: an adapter's holders."""
        candidates = self._table.candidates(call.model) if routes is None else routes
        if not candidates:
            if self._table.has_replicas(call.model):
                raise ErrorKind.REPLICAS_SATURATED.error(model=call.model)
            raise ErrorKind.NO_READY_REPLICA.error(model=call.model)
        choice = None
        if routes is None and self._affinity is not None:
            choice = self._choose(call, candidates)
            candidates = choice.order
        last_error = ""
        for route in candidates:
            if route.saturated():  # filled up while we tried another
                continue
            try:
                return await self._try_unstuck(route, call, choice)
            except UpstreamConnectError as exc:
                # Nothing reached the client (nor the engine, but for a host gone, whose
                # work cannot come back): another replica may answer.
                route.eject(PASSIVE_EJECT_S)
                self._unreachable(route)
                if route.node_lost:
                    route.answering = False  # the probe says when it answers again
                last_error = f"{route.replica_id}: {exc!r}"
                self._metrics.upstream_errors.labels(call.model, route.replica_id, "connect").inc()
                log.warning("replica %s unreachable, failing over: %s", route.replica_id, exc)
            except UpstreamError as exc:
                # The engine may have started on it: no second try.
                if _was_reset(exc):
                    self._unreachable(route)
                self._metrics.upstream_errors.labels(call.model, route.replica_id, "send").inc()
                # The client learns no address or path of ours; the log has them.
                reason = f"replica {route.replica_id} failed the request: {exc!r}"
                raise ErrorKind.UPSTREAM_FAILED.error(
                    model=call.model, reason=reason, incidents=self.incidents
                ) from exc
        if not last_error:  # every candidate filled up before its turn
            raise ErrorKind.REPLICAS_SATURATED.error(model=call.model)
        reason = f"no replica could be reached; the last: {last_error}"
        raise ErrorKind.UPSTREAM_FAILED.error(
            model=call.model, reason=reason, incidents=self.incidents
        )

    async def _try_unstuck(
        self, route: Route, call: Call, choice: Choice | None
    ) -> Reply | StreamReply:
        """``_try``, once more on the same replica when its pinned slot was
        stuck (SlotStuck: that slot is now left out, so another or the
        engine's choice)."""
        try:
            return await self._try(route, call, choice)
        except SlotStuck:
            self._metrics.upstream_errors.labels(call.model, route.replica_id, "slot_stuck").inc()
        try:
            return await self._try(route, call, choice)
        except SlotStuck as exc:
            reason = f"replica {exc}: no first byte from two slots"
            raise ErrorKind.UPSTREAM_FAILED.error(
                model=call.model, reason=reason, incidents=self.incidents
            ) from exc

    def _choose(self, call: Call, candidates: list[Route]) -> Choice:
        """The affinity's order of ``candidates``, counted and on the span."""
        assert self._affinity is not None
        if call.prompt_key is None and len(candidates) <= 1:
            # No key (the model has one replica: router/api/openai.py) and
            # nothing to order: what the affinity would answer, without it.
            choice = Choice(candidates, Reason.LEAST_LOADED, 0)
        else:
            choice = self._affinity.choose(call.spec, candidates, call.prompt_key)
        self._metrics.route_chosen(call.model, choice.reason.value)
        if call.traced:
            span = trace.get_current_span()
            span.set_attribute("llmgw.route.reason", choice.reason.value)
            span.set_attribute("llmgw.route.predicted_cached_tokens", choice.predicted)
        return choice

    def _served(
        self, route: Route, call: Call, choice: Choice | None, usage: "Usage | None"
    ) -> None:
        """Tell the affinity (once per request) what the engine it was sent to
        served: the replica, and the prompt and cached tokens it reported
        (None: no usage came, a stream cut short)."""
        if choice is None or self._affinity is None:
            return
        predicted = choice.predicted if choice.order and choice.order[0] is route else 0
        prompt = usage.prompt_tokens if usage is not None else None
        cached = usage.cached_tokens if usage is not None else None
        # A replica that left the table (or moved) while this request ran was
        # forgotten: what it served must not bring its entries back. Without
        # a key there is nothing to learn; the metrics below count it still.
        if call.prompt_key is not None and any(
            r is route for r in self._table.routes.get(call.model, ())
        ):
            self._affinity.served(
                call.model, route.replica_id, call.prompt_key, choice, prompt, cached
            )
        self._metrics.route_served(call.model, route.replica_id, prompt or 0, cached, predicted)

    def _body(self, route: Route, call: Call) -> tuple[bytes, int | None, int | None]:
        """The body for ``route``, the llama.cpp slot it is pinned to there
        (catalog ``routing.slots``; router/affinity/slots.py; on the span),
        held until released (None: unpinned), and the slot to copy into it
        first (None: none; router/forwarding/slot_priming.py)."""
        body = call.body if call.body_for is None else call.body_for(route)
        if self._salt_of is not None and salts(call.spec, call.cache_scope):
            body = with_field(body, SALT_FIELD, self._salt(call.cache_scope))
        if self._affinity is None:
            return body, None, None
        slot = self._affinity.pin(call.spec, route.replica_id, call.prompt_key)
        if slot is None:
            if self._affinity.pins(call.spec):
                # Unpinned on a model whose slots the router pins: the engine
                # picks (-1), never the client (a tenant holding a slot would
                # queue other conversations behind it).
                return with_slot(body, ANY_SLOT), None, None
            return body, None, None
        donor = self._affinity.primer(call.spec, route.replica_id, slot, call.prompt_key)
        if call.traced:
            span = trace.get_current_span()
            span.set_attribute("llmgw.route.slot", slot)
            if donor is not None:
                span.set_attribute("llmgw.route.primed_from", donor)
        return with_slot(body, slot), slot, donor

    def chain_scope(self, scope: str) -> str:
        """What seeds the prompt chains of ``scope`` in the index
        (router/affinity/chunks.py): its salt, so that nobody without the
        router's secret can tell where another scope's conversation on a
        given prompt was placed (key ids are small numbers: the id alone
        would let a tenant compute another's rendezvous choice for a guess,
        and read it back through where its own new conversations balance);
        "" (shared) as it is."""
        if not scope or self._salt_of is None:
            return scope
        return self._salt(scope).decode()[1:-1]

    def _salt(self, scope: str) -> bytes:
        """The JSON string of ``scope``'s cache salt (computed once per scope)."""
        salt = self._salts.get(scope)
        if salt is None:
            assert self._salt_of is not None
            if len(self._salts) >= MAX_CACHED_SALTS:
                self._salts.clear()
            salt = self._salts[scope] = b'"%s"' % self._salt_of(scope).encode()
        return salt

    def _replica_header(self, route: Route) -> list[tuple[bytes, bytes]]:
        return [(REPLICA_HEADER, route.replica_id.encode())] if self._expose_replica else []

    async def _prime(self, route: Route, call: Call, donor: int | None, slot: int | None) -> None:
        """Copy ``donor`` into ``slot``, if both (bounded; unprimed, the request goes anyway)."""
        if donor is None or slot is None:
            return
        headers = self._engine_headers(route.replica_id)
        primed = await self._primer.prime(route.replica_id, route.endpoint, headers, donor, slot)
        if call.traced:
            trace.get_current_span().set_attribute("llmgw.route.primed", primed)

    def _release(self, route: Route, slot: int | None, answered: bool) -> None:
        """The request's slot is free; ``answered``: the engine sent its
        first byte (headers: llama.cpp sends a stream's with its first token)."""
        if self._affinity is not None:
            self._affinity.release(route.replica_id, slot, answered)

    def _stream_served(
        self,
        route: Route,
        call: Call,
        choice: Choice | None,
        slot: int | None,
        usage: "Usage | None",
    ) -> None:
        """A relayed stream ended: its slot is free, and what it served is learnt."""
        self._release(route, slot, answered=True)
        self._served(route, call, choice, usage)

    def _answered(
        self,
        route: Route,
        call: Call,
        choice: Choice | None,
        outcome: RequestOutcome,
        client_left: bool,
    ) -> None:
        """A whole (non-streamed) answer came: billed (a client gone while the
        engine finished: what it generated, as gone) and, a 200, served."""
        call.bill.answered(outcome, client_left=client_left)
        if outcome.status == 200:
            self._served(route, call, choice, Usage.of(outcome))

    async def _post(
        self,
        route: Route,
        call: Call,
        body: bytes,
        headers: dict[str, str],
        slot: int | None,
    ) -> UpstreamResponse:
        """Send to the engine; a pinned stream's first byte bounded by
        ``stuck_s`` (a non-streamed answer's headers come with its end, so
        only a stream can tell waiting from generating)."""
        url = f"{route.endpoint}{call.path}"
        if slot is None or not call.stream:
            return await self._http.post(url, body, headers)
        try:
            async with asyncio.timeout(self._stuck_s):
                return await self._http.post(url, body, headers)
        except TimeoutError:
            if self._affinity is not None:
                self._affinity.block(route.replica_id, slot, self._stuck_s)
            raise SlotStuck(route, slot) from None

    def _key_refused(self, route: Route, call: Call) -> LlmgwError:
        """The engine refused our key: a router/agent secret mismatch."""
        self._metrics.upstream_errors.labels(call.model, route.replica_id, "engine_key").inc()
        log.error("replica %s rejected the engine key", route.replica_id)
        reason = f"replica {route.replica_id} refused the router's engine key"
        return ErrorKind.UPSTREAM_FAILED.error(
            model=call.model, reason=reason, incidents=self.incidents
        )

    def _unreachable(self, route: Route) -> None:
        if self._on_unreachable is not None:
            self._on_unreachable(route.replica_id, route.endpoint)

    async def _try(self, route: Route, call: Call, choice: Choice | None) -> Reply | StreamReply:
        headers = self._engine_headers(route.replica_id)
        if call.traced:
            # The request's span continues in the engine (traceparent).
            headers = dict(headers)
            inject(headers)
            trace.get_current_span().set_attribute("llmgw.replica", route.replica_id)
        body, slot, donor = self._body(route, call)
        route.inflight += 1
        relayed = answered = False
        try:
            # Engines answer a non-streamed request only once it is generated:
            # a client that leaves meanwhile cancels it (closing the engine
            # connection: vLLM aborts it), unless the engine generates on
            # regardless (llama.cpp, checked with this project's build, finishes
            # a non-streamed request: the router awaits it to bill what it
            # generated, and the reply goes nowhere). One watch for the whole
            # exchange; a stream's relay watches for itself.
            async with cancelled_if_gone(
                call.client_gone, cancel=not call.finishes_when_gone
            ) as watch:
                await self._prime(route, call, donor, slot)
                upstream = await self._post(route, call, body, headers, slot)
                answered = True
                if upstream.status == 401:
                    upstream.close()
                    raise self._key_refused(route, call)
                if upstream.status == 404 and call.stale_on_404:
                    upstream.close()
                    log.info("replica %s does not hold %s", route.replica_id, call.model)
                    raise StaleAdapter(route)
                media = upstream.content_type
                if call.stream and upstream.status == 200:
                    relayed = True  # the relay releases the replica (and its slot)
                    served = partial(self._stream_served, route, call, choice, slot)
                    hide = hides_cached(call.spec, call.cache_scope)
                    relay = Relay(upstream, route, call, self._metrics, self._pacer, served, hide)
                    return StreamReply(relay, media, self._replica_header(route))
                try:
                    content = await upstream.read()
                except UpstreamError as exc:
                    self._metrics.upstream_errors.labels(call.model, route.replica_id, "read").inc()
                    call.bill.failed(502)
                    reason = f"replica {route.replica_id} broke off its answer: {exc!r}"
                    raise ErrorKind.UPSTREAM_FAILED.error(
                        model=call.model, reason=reason, incidents=self.incidents
                    ) from exc
                finally:
                    upstream.close()
            if watch.cut:
                # Gone before the answer: nothing generated is known, and the
                # engine may have generated up to the reservation.
                call.bill.abandoned()
                raise ErrorKind.CLIENT_GONE.error()
        finally:
            if not relayed:
                route.inflight -= 1
                self._release(route, slot, answered)
        # A client gone while the engine finished: billed what it generated, as gone.
        self._answered(route, call, choice, outcome_of(upstream.status, content), watch.left)
        if upstream.status >= 500:
            # An engine's (or its pass-through's) own failure: its text may
            # name paths, exceptions or what its log said; admins see it.
            answer = content[:2000].decode(errors="replace")
            reason = f"replica {route.replica_id}: {answer}"
            raise engine_failed(call.model, upstream.status, reason, self.incidents)
        return self._whole(route, call, upstream.status, media, content)

    def _whole(self, route: Route, call: Call, status: int, media: str, content: bytes) -> Reply:
        """A whole answer as the client gets it: on an engine whose cache other
        scopes share, without its cache figures (billed and learnt from before,
        as the engine said them)."""
        if status == 200 and hides_cached(call.spec, call.cache_scope):
            content = hidden(content)
        return Reply(
            status,
            [
                *self._replica_header(route),
                (b"content-length", b"%d" % len(content)),
                (b"content-type", media_header(media)),
            ],
            content,
        )


def _was_reset(exc: BaseException) -> bool:
    """Whether a connection was reset or closed under the request (what
    answered on that port may not be what was proven there)."""
    cause = exc.__cause__
    return isinstance(cause, ConnectionResetError | aiohttp.ServerDisconnectedError) or (
        isinstance(cause, aiohttp.ClientOSError) and cause.errno == errno.ECONNRESET
    )
