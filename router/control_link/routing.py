"""The routing table: replica state read off Temporal in the background.

Requests never await Temporal: a background task reads the running replica
workflows (their memo carries model, phase and endpoint; the Temporal source
is :mod:`router.control_link.replica_source`) and swaps in a new table; a failed refresh
keeps the last good one. The catalog (read in a
thread) gives each model's in-flight cap.

Balancing: least outstanding requests among the model's routable replicas
(ready, or node-lost while their engine answers), ties broken round-robin; a
replica at its model's ``profile.max_inflight`` is skipped. Draining (and
every other) replica is not in the table, so it gets nothing new.

Health is the router's own evidence, not only the memo's (DESIGN §8): a
replica whose engine refused a connection is passed over for a few seconds
while others can serve, and one whose node is lost is probed by
:mod:`router.forwarding.health` and left out while its engine does not answer.

Only endpoints on nodes the Fleet has registered are routed to: a Replica
memo is written by whoever can start a workflow, and the router would send
it client prompts and an engine key. On a registered node any process can
listen, so ``llmgw router`` also routes only to endpoints that proved they
hold the replica's engine key (router/control_link/endpoint_proof.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from llmgw.errors import StoreError
from llmgw.types import ROUTABLE_PHASES, ModelSpec, ReplicaMemo, ReplicaPhase
from router.common.blocking import STORE_WAIT_S, within

log = logging.getLogger(__name__)

# A request naming a model the table does not know re-reads the catalog once
# (RoutingTable.knows), at most this often, and waits this long for it.
REREAD_INTERVAL_S = 1.0
REREAD_WAIT_S = 2.0


class ReplicaSource(Protocol):
    """Where the router learns which replicas exist."""

    async def replicas(self) -> list[ReplicaMemo]:
        """Every running replica's memo."""
        ...


@runtime_checkable
class CountedSource(Protocol):
    """A source that tells when its replicas changed: a table fed by it is
    rebuilt only then (at 10,000 replicas a rebuild is ~17 ms of the loop)."""

    generation: int  # bumped whenever replicas() returns a different list


@runtime_checkable
class NotifyingSource(Protocol):
    """A source whose replicas may change between two listings (an endpoint
    proof landed, router/control_link/endpoint_proof.py): it says so, and the table is
    rebuilt at once from what the source holds (:meth:`held`), rather than
    at the next interval and without a new listing."""

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` on each such change."""
        ...

    def held(self) -> list[ReplicaMemo]:
        """The replicas from the last listing, as they stand now."""
        ...


def on_registered_nodes(
    memos: list[ReplicaMemo], nodes: Mapping[str, str]
) -> tuple[list[ReplicaMemo], list[ReplicaMemo]]:
    """Split memos into those whose endpoint is on its registered node and the rest.

    ``nodes`` maps a registered node to the address its engines listen on. A
    memo without an endpoint is kept (nothing is sent to it).
    """
    kept: list[ReplicaMemo] = []
    foreign: list[ReplicaMemo] = []
    for memo in memos:
        if not memo.endpoint:
            kept.append(memo)
            continue
        address = nodes.get(memo.node_id)
        host = urlsplit(memo.endpoint).hostname
        (kept if address is not None and host == address else foreign).append(memo)
    return kept, foreign


@dataclass
class Route:
    """A replica the router can send requests to."""

    replica_id: str
    model: str
    endpoint: str
    inflight: int = 0
    cap: int = 0  # 0 = no cap
    node_id: str = ""
    # LoRA adapters its engine holds, per its memo (llama.cpp: in id order).
    adapters: list[str] = field(default_factory=list)
    # Its node's agent is silent: only the router's own probe vouches for it.
    node_lost: bool = False
    # The last active probe's verdict (probed only while node_lost).
    answering: bool = True
    # Passive health: passed over until then (time.monotonic()) while
    # another replica can serve, after the engine refused a connection.
    ejected_until: float = 0.0

    def saturated(self) -> bool:
        """Whether the replica is at its in-flight cap."""
        return self.cap > 0 and self.inflight >= self.cap

    def eject(self, seconds: float) -> None:
        """Pass this replica over for ``seconds`` (it just failed a request)."""
        self.ejected_until = time.monotonic() + seconds


@dataclass
class RoutingTable:
    """Routes by model; rebuilt wholesale on each refresh."""

    routes: dict[str, list[Route]] = field(default_factory=dict)
    known_models: set[str] = field(default_factory=set)
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    # Adapter name -> its base model (clients address an adapter as the model).
    adapter_base: dict[str, str] = field(default_factory=dict)
    # Every running replica as last seen, whatever its phase (admin API).
    replicas: list[ReplicaMemo] = field(default_factory=list)
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    # Called after each rebuild (the admission queue dispatches to new replicas).
    on_update: list[Callable[[], None]] = field(default_factory=list)
    # Told the id of each replica whose engine's cache is no longer the one
    # routed to: it left the routes (drained, stopped, failed, scaled to
    # zero) or its endpoint changed (a new engine). Cache-aware routing
    # forgets what it held (router/affinity/; injected: this layer is below it).
    on_forget: list[Callable[[str], None]] = field(default_factory=list)
    # Set: refresh now rather than at the next interval (a wake answered ready).
    _wanted: asyncio.Event = field(default_factory=asyncio.Event)
    # An unknown model name re-reads the catalog at most this often (``knows``).
    reread_interval_s: float = REREAD_INTERVAL_S
    # How long a request for an unknown name waits for that re-read.
    reread_wait_s: float = REREAD_WAIT_S
    _reread_at: float = -math.inf
    _reread: asyncio.Future[None] | None = None
    # Re-reads asked for that the next refresh (begun after the ask) answers.
    _asked: list[asyncio.Future[None]] = field(default_factory=list)
    # A full refresh (a new listing) is wanted, not only a rebuild (rebuild_soon).
    _full: bool = False
    # A model's in-flight cap per replica (Route.cap), when not its
    # profile.max_inflight alone: cache affinity bounds it by the llama.cpp
    # slots this router pins (router/affinity/; injected: this layer is below it).
    cap_of: Callable[[ModelSpec], int] | None = None

    def refresh_soon(self) -> None:
        """Refresh without waiting for the interval: a replica is known ready
        and requests wait for it (router.admission.queue, after a wake)."""
        self._full = True
        self._wanted.set()

    def rebuild_soon(self) -> None:
        """Rebuild from the replicas the source already holds, now (an
        endpoint proof landed): no new listing, no catalog read."""
        self._wanted.set()

    async def knows(self, model: str) -> bool:
        """Whether ``model`` names a catalog entry, an adapter or a running
        replica's model; for a name the table does not know, after one catalog
        re-read (a model applied a moment ago: the next periodic refresh may be
        a whole interval away). Unknown names share that re-read, at most one
        per ``reread_interval_s`` however many arrive: a client sending made-up
        names cannot make the router read its store on every request."""
        if model in self.known_models or self.has_replicas(model):
            return True
        now = time.monotonic()
        if self._reread is None or (
            self._reread.done() and now - self._reread_at >= self.reread_interval_s
        ):
            self._reread_at = now
            self._reread = asyncio.get_running_loop().create_future()
            self._asked.append(self._reread)
            self.refresh_soon()
        if not self._reread.done():
            with contextlib.suppress(TimeoutError):
                # shield: one request giving up must not cancel the others' wait.
                await asyncio.wait_for(asyncio.shield(self._reread), self.reread_wait_s)
        return model in self.known_models or self.has_replicas(model)

    def refreshing(self) -> Callable[[], None]:
        """A refresh begins: the re-reads asked for until now are answered by
        the callable returned, called once it ended (well or not)."""
        asked, self._asked = self._asked, []

        def ended() -> None:
            for future in asked:
                if not future.done():
                    future.set_result(None)

        return ended

    async def next_refresh(self, interval_s: float) -> bool:
        """Until the next refresh is due: ``interval_s``, or sooner when wanted.
        False when only a rebuild from what is held was asked for."""
        full = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await self._wanted.wait()
                full = self._full
        self._wanted.clear()
        self._full = False
        return full

    def update(self, replicas: list[ReplicaMemo], catalog: dict[str, ModelSpec]) -> None:
        """Replace the routes, keeping in-flight counts of replicas that remain."""
        old = {r.replica_id: r for rs in self.routes.values() for r in rs}
        fresh: dict[str, list[Route]] = {}
        for memo in replicas:
            if memo.phase not in ROUTABLE_PHASES or not memo.endpoint:
                continue
            prev = old.get(memo.replica_id)
            spec = catalog.get(memo.model)
            cap = 0
            if spec is not None:
                cap = self.cap_of(spec) if self.cap_of else spec.profile.max_inflight
            route = prev if prev is not None and prev.endpoint == memo.endpoint else None
            if route is None:
                route = Route(memo.replica_id, memo.model, memo.endpoint)
            route.cap = cap
            route.node_id = memo.node_id
            route.adapters = memo.adapters
            route.node_lost = memo.phase is ReplicaPhase.NODE_LOST
            if not route.node_lost:
                route.answering = True  # its agent vouches for it again
            fresh.setdefault(memo.model, []).append(route)
        self.routes = fresh
        if self.on_forget:
            kept = {id(r) for rs in fresh.values() for r in rs}
            for gone in (r.replica_id for r in old.values() if id(r) not in kept):
                for forget in self.on_forget:
                    forget(gone)
        self.specs = catalog
        self.replicas = replicas
        self.adapter_base = {a.name: s.name for s in catalog.values() for a in s.adapters}
        self.known_models = set(catalog) | {m.model for m in replicas} | set(self.adapter_base)
        for listener in self.on_update:
            listener()

    def candidates(self, model: str) -> list[Route]:
        """Ready, unsaturated replicas of ``model``, least outstanding requests first."""
        routes = self.routes.get(model, [])
        if not routes:
            return []
        # Rotate before the (stable) sort: equal loads take turns.
        turn = next(self._turn) % len(routes)
        rotated = [r for r in routes[turn:] + routes[:turn] if r.answering]
        now = time.monotonic()
        healthy = [r for r in rotated if r.ejected_until <= now]
        # Every replica recently failed: trying one beats refusing outright.
        pool = healthy or rotated
        return sorted((r for r in pool if not r.saturated()), key=lambda r: r.inflight)

    def lost_routes(self) -> list[Route]:
        """Routes whose node is lost: the router probes their engines itself."""
        return [r for rs in self.routes.values() for r in rs if r.node_lost]

    def has_replicas(self, model: str) -> bool:
        """Whether ``model`` has routable replicas (saturated or not)."""
        return any(r.answering for r in self.routes.get(model, []))

    def routable_models(self) -> list[str]:
        """Models with at least one ready replica, and their adapters."""
        adapters = [a for a, base in self.adapter_base.items() if base in self.routes]
        return sorted([*self.routes, *adapters])


def _answers_nothing() -> None:
    """A rebuild's end: it answers no re-read (it read nothing)."""


async def refresh_forever(
    table: RoutingTable,
    source: ReplicaSource,
    catalog: Callable[[], dict[str, ModelSpec]],
    interval_s: float,
    ready: asyncio.Event,
    store_wait_s: float = STORE_WAIT_S,
) -> None:
    """Refresh ``table`` every ``interval_s`` (sooner when it asks: ``refresh_soon``);
    sets ``ready`` after the first success.

    The catalog comes from the store, read within ``store_wait_s``: while the
    store does not answer, the last catalog read serves and replicas keep
    coming and going from Temporal (a frozen store must not freeze routing).
    """
    notifying = isinstance(source, NotifyingSource)
    if isinstance(source, NotifyingSource):
        source.on_change(table.rebuild_soon)
    built: tuple[int, dict[str, ModelSpec]] | None = None  # what the table was built from
    last: dict[str, ModelSpec] | None = None  # the last catalog the store gave
    stale = False  # logged once when the store stops answering, once when it is back
    full = True
    while True:
        # A rebuild (a proof landed) lists nothing and reads no catalog: the
        # re-reads asked for wait for the next full refresh.
        rebuild = not full and notifying and last is not None
        ended = _answers_nothing if rebuild else table.refreshing()
        try:
            if rebuild:
                assert isinstance(source, NotifyingSource) and last is not None
                replicas, specs = source.held(), last
            else:
                replicas = await source.replicas()
                try:
                    specs = last = await within(store_wait_s, catalog)
                    if stale:
                        stale = False
                        log.info("catalog read again")
                except StoreError as exc:
                    if last is None:
                        raise
                    if not stale:
                        stale = True
                        log.warning("catalog not read (%s): the last one read serves", exc)
                    specs = last
            if not isinstance(source, CountedSource):
                table.update(replicas, specs)
            elif built is None or built != (source.generation, specs):
                table.update(replicas, specs)
                built = (source.generation, specs)
            ready.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep the last good table
            log.warning("routing refresh failed: %s", exc)
        ended()
        full = await table.next_refresh(interval_s)
