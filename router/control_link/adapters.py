"""LoRA adapters through the gateway: which replica serves one, and loading on demand.

Clients address an adapter as the OpenAI ``model``; the routing table maps it
to its base model (catalog specs). Two ways an engine holds adapters:

* **static** (llama.cpp, vLLM ``--lora-modules``): every replica of the base
  model holds the catalog's adapters from start (its memo lists them); the
  request goes to the least busy ready one that holds it. llama.cpp selects
  an adapter per request by its index in that replica's list, so the body is
  rewritten per replica (``"lora": [{"id": i, "scale": 1.0}]``).
* **on demand** (vLLM ``runtime_lora``): the router keeps its own view of
  which adapters each replica holds (the memo, plus loads and evictions it
  made that the memo has not caught up with yet), how many requests use each
  and when each was last used; :func:`router.control_link.adapter_policy.choose` decides.
  A load runs as the AdapterLoad workflow (single flight per (replica,
  adapter) in Temporal too); concurrent requests in this router wait on one
  local task, so a cold adapter is loaded once. Only a cold request awaits
  Temporal; a warm one decides from memory.

A failed load fails the requests that waited on it (502 naming the adapter
and the engine's reason) and leaves nothing behind: the next request starts
a new load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from temporalio.client import Client, WorkflowFailureError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from llmgw import contracts, error_types
from llmgw.errors import LlmgwError
from llmgw.queues import CONTROL_QUEUE
from llmgw.types import AdapterLoadInput, AdapterLoadResult, AdapterSpec, EngineKind, ModelSpec
from router.common.errors import ErrorKind
from router.control_link.adapter_policy import Action, AdapterUse, ReplicaView, choose
from router.control_link.routing import Route, RoutingTable

log = logging.getLogger(__name__)

# A load is seconds at most (vLLM: milliseconds); past this the client is told.
LOAD_TIMEOUT = timedelta(seconds=180)


class AdapterUnavailable(LlmgwError):
    """The engine (or Temporal) did not load the adapter; the message says why.

    ``busy``: the adapter chosen for unloading had requests in flight in the
    engine (another router's); nothing changed, another choice may work.
    ``kind``: what failed, in a word the client may see (the message may name
    the node's paths and addresses, so only the log gets it).
    """

    def __init__(self, message: str, *, busy: bool = False, kind: str = "") -> None:
        super().__init__(message)
        self.busy = busy
        self.kind = kind or type(self).__name__


class AdapterLoader(Protocol):
    """Loads a catalog adapter into a replica (the AdapterLoad workflow)."""

    async def load(self, request: AdapterLoadInput) -> AdapterLoadResult:
        """Load it (unloading ``request.evict`` first); AdapterUnavailable if not."""
        ...


def adapter_workflow_id(replica_id: str, adapter: str) -> str:
    """One AdapterLoad per (replica, adapter) at a time (USE_EXISTING)."""
    return f"adapter/{replica_id}/{adapter}"


def _root(err: BaseException) -> str:
    """The innermost cause's message (workflow failure -> activity -> application)."""
    while (cause := getattr(err, "cause", None)) is not None:
        err = cause
    return str(err)


def _kind(err: BaseException) -> str:
    """The innermost application error's type (AdapterNotFound, AdapterLoadFailed...)."""
    kind = ""
    while err is not None:
        if isinstance(err, ApplicationError) and err.type:
            kind = err.type
        err = getattr(err, "cause", None)  # type: ignore[assignment]
    return kind


def _busy(err: BaseException) -> bool:
    """Whether the load failed because its eviction victim was in use."""
    while err is not None:
        if isinstance(err, ApplicationError) and err.type == error_types.ADAPTER_BUSY:
            return True
        err = getattr(err, "cause", None)  # type: ignore[assignment]
    return False


class TemporalAdapterLoader:
    """Runs the AdapterLoad workflow on the control queue and awaits it."""

    def __init__(self, client: Client, task_queue: str = CONTROL_QUEUE) -> None:
        self._client = client
        self._queue = task_queue

    async def load(self, request: AdapterLoadInput) -> AdapterLoadResult:
        """Start or join the (replica, adapter) load and wait for its result."""
        try:
            return await contracts.ADAPTER_LOAD.execute(
                self._client,
                request,
                id=adapter_workflow_id(request.replica_id, request.adapter.name),
                task_queue=self._queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                execution_timeout=LOAD_TIMEOUT,
            )
        except WorkflowFailureError as exc:
            raise AdapterUnavailable(_root(exc), busy=_busy(exc), kind=_kind(exc)) from exc
        except RPCError as exc:
            raise AdapterUnavailable(
                f"Temporal: {exc.message}", kind="TemporalUnavailable"
            ) from exc


@dataclass
class _Replica:
    """The router's own knowledge of one replica's adapters."""

    endpoint: str
    uses: dict[str, AdapterUse] = field(default_factory=dict)
    loading: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Requests waiting for a load here: they count as the replica's load.
    waiting: int = 0
    # What this router loaded / unloaded that the memo may not show yet.
    loaded_here: set[str] = field(default_factory=set)
    # Unloaded adapter -> the one loaded in its place: the replica records
    # both in one signal, so a memo showing the latter has dropped the former.
    evicted_here: dict[str, str] = field(default_factory=dict)
    # Shown held, but the engine answered 404 for them: gone (unloaded by
    # another router) until the memo stops showing them or we load them.
    gone: set[str] = field(default_factory=set)

    def held(self, memo: list[str]) -> set[str]:
        """Adapters the engine holds or is loading, the memo caught up with ours."""
        shown = set(memo)
        self.loaded_here -= shown
        for victim, by in list(self.evicted_here.items()):
            if by in shown:
                del self.evicted_here[victim]
        self.gone &= shown
        held = (shown | self.loaded_here | set(self.loading)) - set(self.evicted_here)
        return held - (self.gone - set(self.loading))


Release = Callable[[], None]


def _static_body(raw: bytes, adapter: str) -> Callable[[Route], bytes]:
    """llama.cpp: the adapter by its index in the chosen replica's list."""
    data = json.loads(raw)
    data["cache_prompt"] = False  # see _llama_cpp_uncached

    def body_for(route: Route) -> bytes:
        data["lora"] = [{"id": route.adapters.index(adapter), "scale": 1.0}]
        return json.dumps(data, separators=(",", ":")).encode()

    return body_for


def base_body(base: ModelSpec, raw: bytes) -> bytes:
    """A request for a base model that has adapters, as its engine gets it.

    llama.cpp: without its per-request ``lora`` field (a key allowed the base
    model only must not reach its adapters that way), and without prompt
    caching: see :func:`_llama_cpp_uncached`.
    """
    return _llama_cpp_uncached(raw) if base.engine is EngineKind.LLAMA_CPP else raw


def _llama_cpp_uncached(raw: bytes) -> bytes:
    """A llama.cpp request without ``lora`` and without prompt caching.

    This project's llama.cpp build reuses a cached prompt's KV computed under
    another adapter (checked: the base answer after an adapter's request on
    the same prompt differs from a fresh one; tests/e2e/test_lora_gateway.py), so
    requests to a model with adapters re-read their prompt.
    """
    data = json.loads(raw)
    data.pop("lora", None)
    data["cache_prompt"] = False
    return json.dumps(data, separators=(",", ":")).encode()


class AdapterRouter:
    """Routes requests for adapters; loads on-demand ones through ``loader``."""

    def __init__(
        self,
        table: RoutingTable,
        loader: AdapterLoader | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._table = table
        self._loader = loader
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}

    def base_of(self, model: str) -> tuple[ModelSpec, AdapterSpec] | None:
        """The base model's spec and the adapter's, when ``model`` is an adapter."""
        base = self._table.adapter_base.get(model)
        spec = self._table.specs.get(base) if base else None
        if spec is None:
            return None
        adapter = next((a for a in spec.adapters if a.name == model), None)
        return (spec, adapter) if adapter else None

    def static_routes(
        self, base: ModelSpec, adapter: str, raw: bytes
    ) -> tuple[list[Route], Callable[[Route], bytes] | None]:
        """Ready replicas of ``base`` holding ``adapter``, least busy first, and the
        body for each (llama.cpp); 503 when none can take it."""
        holders = [r for r in self._table.routes.get(base.name, []) if adapter in r.adapters]
        if not holders:
            raise ErrorKind.NO_READY_REPLICA.error(model=adapter)
        routes = [r for r in self._table.candidates(base.name) if adapter in r.adapters]
        if not routes:
            raise ErrorKind.REPLICAS_SATURATED.error(model=adapter)
        body_for = _static_body(raw, adapter) if base.engine is EngineKind.LLAMA_CPP else None
        return routes, body_for

    def _state(self, route: Route) -> _Replica:
        state = self._replicas.get(route.replica_id)
        if state is None or state.endpoint != route.endpoint:  # a new engine holds nothing
            state = _Replica(route.endpoint)
            self._replicas[route.replica_id] = state
            # Rare (a new replica): forget those that left the table meanwhile.
            live = {r.replica_id for rs in self._table.routes.values() for r in rs}
            for gone in [rid for rid in self._replicas if rid not in live]:
                if not self._replicas[gone].loading:
                    del self._replicas[gone]
        return state

    def _views(self, base: ModelSpec, routes: list[Route]) -> list[ReplicaView]:
        views = []
        for route in routes:
            state = self._state(route)
            loaded = {}
            for name in state.held(route.adapters):
                use = state.uses.get(name) or AdapterUse(last_used=0.0)
                # A load under way is busy: never the one to evict.
                busy = use.in_flight + (1 if name in state.loading else 0)
                loaded[name] = AdapterUse(last_used=use.last_used, in_flight=busy)
            views.append(
                ReplicaView(
                    replica_id=route.replica_id,
                    in_flight=route.inflight + state.waiting,
                    cap=route.cap,
                    max_loaded=base.profile.max_loaded_adapters,
                    loaded=loaded,
                )
            )
        return views

    async def on_demand_route(
        self, base: ModelSpec, adapter: AdapterSpec, *, again: bool = True
    ) -> tuple[Route, Release]:
        """The replica to forward to once it holds ``adapter`` (loaded here if needed),
        and the release to call when the request is over. A load refused because
        its victim was busy elsewhere is chosen again once."""
        routes = self._table.routes.get(base.name, [])
        if not routes:
            raise ErrorKind.NO_READY_REPLICA.error(model=adapter.name)
        choice = choose(adapter.name, self._views(base, routes))
        if choice is None:
            raise ErrorKind.REPLICAS_SATURATED.error(model=adapter.name)
        route = next(r for r in routes if r.replica_id == choice.replica_id)
        state = self._state(route)
        # Counted before any await: concurrent requests see this one.
        use = state.uses.setdefault(adapter.name, AdapterUse(last_used=self._clock()))
        use.in_flight += 1
        use.last_used = self._clock()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                use.in_flight -= 1
                use.last_used = self._clock()

        task = state.loading.get(adapter.name)
        if task is None and choice.action is not Action.USE:
            if self._loader is None:
                release()
                raise ErrorKind.ADAPTERS_UNAVAILABLE.error(adapter=adapter.name)
            if choice.evict:
                state.evicted_here[choice.evict] = adapter.name
                state.loaded_here.discard(choice.evict)
                state.uses.pop(choice.evict, None)
            request = AdapterLoadInput(
                replica_id=route.replica_id,
                node_id=route.node_id,
                adapter=adapter,
                evict=choice.evict,
                max_loaded=base.profile.max_loaded_adapters,
            )
            task = asyncio.create_task(self._load(state, request))
            # Retrieved here too: every waiter may have gone before it failed.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            state.loading[adapter.name] = task
        if task is not None:
            state.waiting += 1
            try:
                # Shielded: a client that leaves does not cancel the others' load.
                await asyncio.shield(task)
            except AdapterUnavailable as exc:
                release()
                if exc.busy and again:
                    return await self.on_demand_route(base, adapter, again=False)
                raise ErrorKind.ADAPTER_LOAD_FAILED.error(
                    adapter=adapter.name, replica_id=route.replica_id, kind=exc.kind
                ) from None
            except BaseException:
                release()
                raise
            finally:
                state.waiting -= 1
        return route, release

    def forget(self, route: Route, adapter: str) -> None:
        """The replica's engine said it does not hold ``adapter``: stop believing it
        (another router unloaded it and the memo has not caught up)."""
        state = self._state(route)
        state.loaded_here.discard(adapter)
        # Its uses stay: requests still running with it keep it from being
        # chosen as an idle victim once it is loaded again.
        state.gone.add(adapter)

    async def _load(self, state: _Replica, request: AdapterLoadInput) -> None:
        assert self._loader is not None
        name = request.adapter.name
        try:
            result = await self._loader.load(request)
            state.loaded_here.add(name)
            state.evicted_here.pop(name, None)
            state.gone.discard(name)
            if result.evicted and result.evicted != request.evict:
                # The engine was fuller than we knew: the node made room itself.
                state.evicted_here[result.evicted] = name
                state.loaded_here.discard(result.evicted)
                state.uses.pop(result.evicted, None)
            log.info(
                "adapter %s loaded on %s%s",
                name,
                request.replica_id,
                f" (unloaded {result.evicted})" if result.evicted else "",
            )
        except AdapterUnavailable as exc:
            log.warning("adapter %s failed to load on %s: %s", name, request.replica_id, exc)
            if exc.busy and request.evict:
                # Still loaded, and in use: shown again, and the most recently
                # used, so the next choice passes it over.
                state.evicted_here.pop(request.evict, None)
                state.loaded_here.add(request.evict)
                state.uses[request.evict] = AdapterUse(last_used=self._clock())
            raise
        except Exception as exc:  # the loader's own failure: same answer to the client
            log.exception("adapter %s: loader failed", name)
            raise AdapterUnavailable(
                f"{type(exc).__name__}: {exc}", kind=type(exc).__name__
            ) from exc
        finally:
            state.loading.pop(name, None)
