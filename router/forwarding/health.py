"""The router's own evidence of engine health (DESIGN §8).

A replica whose node's agent went silent is published ``node-lost``: its
engine may be perfectly well, so it stays in the routing table, and this
module probes it (``GET /health`` through its pass-through, with the
replica's engine key) every couple of seconds. A replica whose engine does
not answer is left out until it does; the replica workflow, probing from
the control plane, decides when it is gone for good.

Passive health lives in the proxy: an engine that refuses a connection is
passed over for ``router.forwarding.proxy.PASSIVE_EJECT_S`` while another replica can serve.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from router.control_link.routing import Route, RoutingTable
from router.forwarding.upstream import IDENTITY

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 2.0


class EngineProbe(Protocol):
    """Whether a replica's engine answers right now."""

    async def answers(self, route: Route) -> bool:
        """True when the engine (not only its pass-through) answered."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class HttpProbe:
    """``GET /health`` with the engine key; any answer but a gateway error counts.

    The pass-through answers 502 when the engine behind it is gone; a 503
    is an engine busy loading, which is not a dead one. With ``prove`` (the
    endpoint proofs, router/control_link/endpoint_proof.py) the endpoint proves it holds
    the replica's key first, which sends none: the key goes only to an
    endpoint that just proved it (a node-lost replica's port may have changed
    hands), and one that does not prove is not answering (its proof dropped).
    """

    def __init__(
        self,
        engine_key: Callable[[str], str],
        timeout_s: float = PROBE_TIMEOUT_S,
        prove: Callable[[str, str], Awaitable[bool]] | None = None,
    ):
        self._engine_key = engine_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._prove = prove

    async def answers(self, route: Route) -> bool:
        """Probe ``route``'s engine once."""
        if self._prove is not None and not await self._prove(route.replica_id, route.endpoint):
            return False
        if self._session is None:
            # Only the status is read, but aiohttp would ask for gzip and
            # expand what came: an engine is an untrusted byte source.
            self._session = aiohttp.ClientSession(timeout=self._timeout, auto_decompress=False)
        headers = {
            "Authorization": f"Bearer {self._engine_key(route.replica_id)}",
            "Accept-Encoding": IDENTITY,
        }
        try:
            async with self._session.get(f"{route.endpoint}/health", headers=headers) as resp:
                return resp.status < 500 or resp.status == 503
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def aclose(self) -> None:
        """Close the probe's connections."""
        if self._session is not None:
            await self._session.close()


async def probe_routes(table: RoutingTable, probe: EngineProbe) -> None:
    """Probe every node-lost replica once and record whether it answers."""
    lost = table.lost_routes()
    if not lost:
        return
    verdicts = await asyncio.gather(*(probe.answers(route) for route in lost))
    for route, answers in zip(lost, verdicts, strict=True):
        if answers != route.answering:
            log.warning(
                "replica %s (node %s lost): engine %s",
                route.replica_id, route.node_id, "answers again" if answers else "not answering",
            )  # fmt: skip
        route.answering = answers


async def probe_forever(
    table: RoutingTable, probe: EngineProbe, interval_s: float = PROBE_INTERVAL_S
) -> None:
    """Probe node-lost replicas every ``interval_s`` until cancelled."""
    while True:
        try:
            await probe_routes(table, probe)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a probe bug must not stop routing
            log.warning("engine probe pass failed: %s", exc)
        await asyncio.sleep(interval_s)
