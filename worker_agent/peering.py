"""Weights node to node: this agent's peer server, and the peers it asks.

Every agent serves its artifact cache to the cluster's agents
(worker_agent/fetch/peer_server.py, authenticated by a credential derived
from the engine-key secret) and advertises the URL in its inventory
(``NodeInventory.peer_url``). Before a fetch, the agent reads the fleet (one
query) for nodes that hold or are fetching the same model: nodes where a
replica of it is placed, oldest placement first, or the nodes the workflow
named. They are asked before the origin; whatever they send is verified
against the pin, so a dead or lying peer costs one try, never a wrong file.
"""

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import uvicorn
from temporalio.client import Client

from llmgw import contracts
from llmgw.queues import FLEET_WORKFLOW_ID
from llmgw.types import FetchWeightsInput, FleetSnapshot
from worker_agent.fetch import Peer, PeerServer, peer_headers

log = logging.getLogger(__name__)

# Peers asked per fetch at most: more only adds tries before the origin.
MAX_PEERS = 3
SNAPSHOT_TIMEOUT_S = 5.0


def peers_for(
    fleet: FleetSnapshot, request: FetchWeightsInput, node_id: str, key: str
) -> tuple[Peer, ...]:
    """The peers ``node_id`` asks for ``request``'s weights (pure: tested alone).

    The workflow's ``peer_nodes`` when given; else every other node where a
    replica of the same model was placed before this one, oldest placement
    first (the likeliest to hold it whole). Only those before it: replicas
    placed together (a deploy's) would otherwise each ask the others first,
    all still empty, each waiting out every peer's 404 and then all going to
    the origin (issue 36 scenario 10: 3 replicas, 20 s lost, the origin sent
    the file twice). In this order the first placed fetches from the origin at
    once and the others follow its growing copy. A replica not in the fleet
    (not placed yet) asks every one. Nodes that advertise no peer server are
    left out.
    """
    chosen: list[str] = list(request.peer_nodes)
    if not chosen and request.model:
        for placement in fleet.allocations.values():  # in the order they were placed
            if placement.replica_id == request.replica_id:
                break
            if placement.model == request.model:
                chosen.extend(s.node_id for s in placement.shards())
    found: list[Peer] = []
    for node in dict.fromkeys(chosen):  # in order, once each
        inventory = fleet.nodes.get(node)
        if node == node_id or inventory is None or not inventory.peer_url:
            continue
        found.append(Peer(node, inventory.peer_url, peer_headers(key)))
        if len(found) == MAX_PEERS:
            break
    return tuple(found)


@dataclass
class FleetPeers:
    """Finds a fetch's peers in the fleet; ``client`` is set once connected."""

    node_id: str
    key: str = field(repr=False)
    client: Client | None = None

    async def find(self, request: FetchWeightsInput) -> tuple[Peer, ...]:
        """The peers to ask first; none when the fleet cannot be read (the
        origin serves then: a peer is an optimisation, never a dependency)."""
        if self.client is None:
            return ()
        handle = self.client.get_workflow_handle(FLEET_WORKFLOW_ID)
        try:
            fleet = await asyncio.wait_for(
                contracts.SNAPSHOT.ask(
                    handle, None, rpc_timeout=timedelta(seconds=SNAPSHOT_TIMEOUT_S)
                ),
                SNAPSHOT_TIMEOUT_S + 1,
            )
        except Exception as exc:
            log.warning("replica %s: no peers (fleet unread: %s)", request.replica_id, exc)
            return ()
        peers = peers_for(fleet, request, self.node_id, self.key)
        if peers:
            log.info(
                "replica %s: asking peers %s before the origin",
                request.replica_id,
                ", ".join(p.name for p in peers),
            )
        return peers


@dataclass
class ServedPeers:
    """The running peer server: its URL, and how to stop it."""

    url: str
    server: uvicorn.Server
    task: "asyncio.Task[None]"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


class _Server(uvicorn.Server):
    """uvicorn's server, leaving SIGINT/SIGTERM to the agent (its
    stop_event_on_signals): uvicorn swaps the process's handlers while it
    serves from the main thread."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class NoPeers:
    """No peer server (``serve_peers`` off): nothing to stop."""

    async def stop(self) -> None:
        return None


async def serve_peers(root: Path, key: str, host: str, port: int, url: str = "") -> ServedPeers:
    """Serve the cache at ``root`` on ``host:port`` (0: a free port); ``url``
    is what other agents are told (empty: ``http://host:port``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        PeerServer(root, key).app, log_level="warning", lifespan="off", access_log=False
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    shown = f"[{host}]" if ":" in host else host
    return ServedPeers(url or f"http://{shown}:{bound}", server, task)
