"""The routing table: replica state read off Temporal in the background.

Requests never await Temporal: a background task lists the running replica
workflows (their memo carries model, phase and endpoint) and swaps in a new
table; a failed refresh keeps the last good one.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from temporalio.client import Client

from llmgw.types import ReplicaMemo, ReplicaPhase

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


@dataclass
class RoutingTable:
    """Routes by model; rebuilt wholesale on each refresh."""

    routes: dict[str, list[Route]] = field(default_factory=dict)
    known_models: set[str] = field(default_factory=set)

    def update(self, replicas: list[ReplicaMemo], catalog: set[str]) -> None:
        """Replace the routes, keeping in-flight counts of replicas that remain."""
        old = {r.replica_id: r for rs in self.routes.values() for r in rs}
        fresh: dict[str, list[Route]] = {}
        for memo in replicas:
            if memo.phase is not ReplicaPhase.READY or not memo.endpoint:
                continue
            prev = old.get(memo.replica_id)
            route = Route(memo.replica_id, memo.model, memo.endpoint, prev.inflight if prev else 0)
            fresh.setdefault(memo.model, []).append(route)
        self.routes = fresh
        self.known_models = catalog | {m.model for m in replicas}

    def candidates(self, model: str) -> list[Route]:
        """Ready replicas of ``model``, least outstanding requests first."""
        return sorted(self.routes.get(model, []), key=lambda r: (r.inflight, r.replica_id))

    def routable_models(self) -> list[str]:
        """Models with at least one ready replica."""
        return sorted(self.routes)


async def refresh_forever(
    table: RoutingTable,
    source: ReplicaSource,
    catalog: Callable[[], set[str]],
    interval_s: float,
    ready: asyncio.Event,
) -> None:
    """Refresh ``table`` every ``interval_s``; sets ``ready`` after the first success."""
    while True:
        try:
            replicas = await source.replicas()
            names = await asyncio.to_thread(catalog)
            table.update(replicas, names)
            ready.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep the last good table
            log.warning("routing refresh failed: %s", exc)
        await asyncio.sleep(interval_s)
