"""Remote weights on a node: a pinned source fetched once into the artifact
cache (worker_agent/fetch/), each replica recorded as a user of its entry
until it stops, so the cache's budget never evicts weights an engine reads.
"""

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace

from llmgw.types.shard import FetchProgressDetail, FetchWeightsInput, FetchWeightsResult
from worker_agent.fetch import ArtifactCache, FetchProgress, Peer
from worker_agent.fetch.cache import USERS_SUFFIX
from worker_agent.heartbeats import FetchHeartbeat, beating_while
from worker_agent.origins import Origins, artifact_for
from worker_agent.weights import UnsupportedSource

log = logging.getLogger(__name__)

ProgressFn = Callable[[FetchProgressDetail], None]


@dataclass(frozen=True)
class RemoteFetched:
    """A pinned artifact on the node: what the engine opens, and the entry."""

    path: Path
    key: str
    tree_sha256: str
    size_bytes: int
    cached: bool
    bytes_by_source: dict[str, int]


def detail_of(progress: FetchProgress) -> FetchProgressDetail:
    """A heartbeat's details (shown by the Temporal UI and ``llmgw explain``)."""
    return FetchProgressDetail(
        files_done=progress.files_done,
        files_total=progress.files_total,
        bytes_done=progress.bytes_done,
        bytes_total=progress.bytes_total,
        rate_bps=progress.rate_bps,
        source=progress.source,
    )


PeerFinder = Callable[[FetchWeightsInput], Awaitable[tuple[Peer, ...]]]
"""The nodes to ask before the origin (worker_agent/peering.py FleetPeers.find)."""


class RemoteWeights:
    """Pinned remote sources fetched into ``cache`` from ``origins``, peers
    (``find_peers``) asked first."""

    def __init__(
        self, cache: ArtifactCache, origins: Origins, find_peers: PeerFinder | None = None
    ) -> None:
        self.cache = cache
        self.origins = origins
        self.find_peers = find_peers

    def fetch(
        self,
        request: FetchWeightsInput,
        peers: tuple[Peer, ...] = (),
        progress: ProgressFn | None = None,
    ) -> RemoteFetched:
        """The pinned files on this node (fetched on a miss), ``peers`` asked
        before the origin; the replica recorded as a user of the entry unless
        ``request.hold`` is false (a pull).

        Blocking (run it in a thread). Raises UnsupportedSource for a source
        nodes cannot fetch or a request without a pin, and the fetch
        library's WeightsErrors.
        """
        if request.pin is None:
            raise UnsupportedSource(f"{request.source}: no pin to fetch")
        pinned = artifact_for(request.source, request.pin, self.origins, request.storage_profile)
        spec = dataclasses.replace(pinned.spec, peers=peers)

        def report(p: FetchProgress) -> None:
            if progress is not None:
                progress(detail_of(p))

        user = request.replica_id if request.hold else None
        got = self.cache.fetch(spec, user=user, progress=report)
        path = got.path / pinned.file if pinned.file else got.path
        return RemoteFetched(
            path, got.key, got.sha256, got.size_bytes, got.cached, dict(got.bytes_by_source)
        )

    def release(self, replica_id: str) -> None:
        """``replica_id`` stopped: its entries may be evicted once no one else uses them."""
        root = self.cache.root
        if not root.is_dir():
            return
        for users in root.glob(f"*{USERS_SUFFIX}"):
            if (users / replica_id).exists():
                self.cache.release(users.name.removesuffix(USERS_SUFFIX), replica_id)
                log.info("replica %s no longer uses artifact %s", replica_id, users.name)


async def fetch_pinned(
    remote: RemoteWeights, request: FetchWeightsInput, heartbeat: FetchHeartbeat
) -> FetchWeightsResult:
    """The fetch activity for a pinned remote source: heartbeats carry a
    FetchProgressDetail, the span the artifact and whether it was cached."""
    pin = request.pin
    if pin is None:
        raise ValueError("fetch_pinned needs a pinned request")
    last: list[str | FetchProgressDetail] = [f"fetching {request.source}"]

    def progress(detail: FetchProgressDetail) -> None:
        last[0] = detail  # read by the heartbeat loop

    tracer = trace.get_tracer(__name__)
    with tracer.start_as_current_span("llmgw.weights.fetch") as span:
        span.set_attribute("llmgw.replica_id", request.replica_id)
        span.set_attribute("llmgw.weights.artifact", pin.artifact_id())
        span.set_attribute("llmgw.weights.bytes", pin.total_bytes())
        peers = await remote.find_peers(request) if remote.find_peers is not None else ()
        span.set_attribute("llmgw.weights.peers", [p.name for p in peers])
        fetched = await beating_while(
            asyncio.to_thread(remote.fetch, request, peers, progress),
            heartbeat,
            lambda: last[0],
        )
        for source, moved in fetched.bytes_by_source.items():
            span.set_attribute(f"llmgw.weights.bytes_from.{source}", moved)
        span.set_attribute("llmgw.weights.cached", fetched.cached)
    log.info(
        "replica %s weights %s at %s (%d bytes, %s)",
        request.replica_id,
        pin.artifact_id(),
        fetched.path,
        fetched.size_bytes,
        "cached" if fetched.cached else "fetched",
    )
    return FetchWeightsResult(
        path=str(fetched.path),
        sha256=fetched.tree_sha256,
        size_bytes=fetched.size_bytes,
        cached=fetched.cached,
        bytes_by_source=fetched.bytes_by_source,
    )
