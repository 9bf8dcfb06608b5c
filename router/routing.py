"""The routing table: replica state read off Temporal in the background.

Requests never await Temporal: a background task lists the running replica
workflows (their memo carries model, phase and endpoint) and swaps in a new
table; a failed refresh keeps the last good one. The catalog (read in a
thread) gives each model's in-flight cap.

Balancing: least outstanding requests among the model's Ready replicas,
ties broken round-robin; a replica at its model's ``profile.max_inflight``
is skipped. Draining (and every other non-Ready) replica is not in the table,
so it gets nothing new.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from temporalio.client import Client

from llmgw.types import ModelSpec, ReplicaMemo, ReplicaPhase
from router.blocking import in_thread

log = logging.getLogger(__name__)

# Bounded: a slow Temporal delays a refresh, never a request.
LIST_RPC_TIMEOUT = timedelta(seconds=5)
LIST_QUERY = 'WorkflowType="Replica" AND ExecutionStatus="Running"'


class ReplicaSource(Protocol):
    """Where the router learns which replicas exist."""

    async def replicas(self) -> list[ReplicaMemo]:
        """Every running replica's memo."""
        ...


class TemporalReplicaSource:
    """Reads replica memos with one visibility list call."""

    def __init__(self, client: Client) -> None:
        self._client = client

    async def replicas(self) -> list[ReplicaMemo]:
        """Every running replica workflow's published state."""
        found: list[ReplicaMemo] = []
        async for wf in self._client.list_workflows(LIST_QUERY, rpc_timeout=LIST_RPC_TIMEOUT):
            memo = await wf.memo()
            raw = memo.get("replica")
            if isinstance(raw, dict):
                found.append(ReplicaMemo.model_validate(raw))
        return found


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

    def saturated(self) -> bool:
        """Whether the replica is at its in-flight cap."""
        return self.cap > 0 and self.inflight >= self.cap


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

    def update(self, replicas: list[ReplicaMemo], catalog: dict[str, ModelSpec]) -> None:
        """Replace the routes, keeping in-flight counts of replicas that remain."""
        old = {r.replica_id: r for rs in self.routes.values() for r in rs}
        fresh: dict[str, list[Route]] = {}
        for memo in replicas:
            if memo.phase is not ReplicaPhase.READY or not memo.endpoint:
                continue
            prev = old.get(memo.replica_id)
            spec = catalog.get(memo.model)
            cap = spec.profile.max_inflight if spec else 0
            route = prev if prev is not None and prev.endpoint == memo.endpoint else None
            if route is None:
                route = Route(memo.replica_id, memo.model, memo.endpoint)
            route.cap = cap
            route.node_id = memo.node_id
            route.adapters = memo.adapters
            fresh.setdefault(memo.model, []).append(route)
        self.routes = fresh
        self.specs = catalog
        self.replicas = replicas
        self.adapter_base = {a.name: s.name for s in catalog.values() for a in s.adapters}
        self.known_models = set(catalog) | {m.model for m in replicas} | set(self.adapter_base)

    def candidates(self, model: str) -> list[Route]:
        """Ready, unsaturated replicas of ``model``, least outstanding requests first."""
        routes = self.routes.get(model, [])
        if not routes:
            return []
        # Rotate before the (stable) sort: equal loads take turns.
        turn = next(self._turn) % len(routes)
        rotated = routes[turn:] + routes[:turn]
        return sorted((r for r in rotated if not r.saturated()), key=lambda r: r.inflight)

    def has_replicas(self, model: str) -> bool:
        """Whether ``model`` has Ready replicas (saturated or not)."""
        return bool(self.routes.get(model))

    def routable_models(self) -> list[str]:
        """Models with at least one ready replica, and their adapters."""
        adapters = [a for a, base in self.adapter_base.items() if base in self.routes]
        return sorted([*self.routes, *adapters])


async def refresh_forever(
    table: RoutingTable,
    source: ReplicaSource,
    catalog: Callable[[], dict[str, ModelSpec]],
    interval_s: float,
    ready: asyncio.Event,
) -> None:
    """Refresh ``table`` every ``interval_s``; sets ``ready`` after the first success."""
    while True:
        try:
            replicas = await source.replicas()
            specs = await in_thread(catalog)
            table.update(replicas, specs)
            ready.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep the last good table
            log.warning("routing refresh failed: %s", exc)
        await asyncio.sleep(interval_s)
