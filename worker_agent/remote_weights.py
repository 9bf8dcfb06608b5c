"""Remote weights on a node: a pinned source fetched once into the artifact
cache (worker_agent/fetch/), each replica recorded as a user of its entry
until it stops, so the cache's budget never evicts weights an engine reads.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace

from llmgw.types.shard import FetchProgressDetail, FetchWeightsInput, FetchWeightsResult
from llmgw.types.weights_manifest import SourcePin
from worker_agent.fetch import ArtifactCache, FetchProgress
from worker_agent.fetch.cache import USERS_SUFFIX
from worker_agent.heartbeats import FetchHeartbeat, beating_while
from worker_agent.origins import Origins, artifact_for

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


class RemoteWeights:
    """Pinned remote sources fetched into ``cache`` from ``origins``."""

    def __init__(self, cache: ArtifactCache, origins: Origins) -> None:
        self.cache = cache
        self.origins = origins

    def fetch(
        self,
        replica_id: str,
        source: str,
        pin: SourcePin,
        progress: ProgressFn | None = None,
        hold: bool = True,
        storage_profile: str | None = None,
    ) -> RemoteFetched:
        """The pinned files on this node (fetched on a miss), used by ``replica_id``.

        ``hold``: record ``replica_id`` as a user of the entry (False: a pull).
        Blocking (run it in a thread). Raises UnsupportedSource for a source
        nodes cannot fetch, and the fetch library's WeightsErrors.
        """
        pinned = artifact_for(source, pin, self.origins, storage_profile)

        def report(p: FetchProgress) -> None:
            if progress is not None:
                progress(detail_of(p))

        got = self.cache.fetch(pinned.spec, user=replica_id if hold else None, progress=report)
        path = got.path / pinned.file if pinned.file else got.path
        return RemoteFetched(path, got.key, got.sha256, got.size_bytes, got.cached)

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
        fetched = await beating_while(
            asyncio.to_thread(
                remote.fetch,
                request.replica_id,
                request.source,
                pin,
                progress,
                request.hold,
                request.storage_profile,
            ),
            heartbeat,
            lambda: last[0],
        )
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
    )
