"""Fetching pinned artifacts (a manifest of files) over HTTP into the node's weights cache.

A later step wires this into ``worker_agent.weights``: the caller builds an
``ArtifactSpec`` from a pinned manifest (per file: URL, request headers,
relative path, size, sha256) and calls ``ArtifactCache(root).fetch(spec,
user=replica_id, progress=...)`` in a thread, turning ``FetchProgress`` into
heartbeats; ``release(key, replica_id)`` when the replica stops.

Layout under the cache root (the same root and conventions as WeightsCache:
an entry is complete only with its ``COMPLETE`` marker, and ``<key>.lock``
serialises fetches of a key across processes)::

    <key>/                      a complete artifact (key: ArtifactSpec.key, from
      COMPLETE                  the files' paths, sizes and digests); the marker,
                                JSON: name, sha256 (tree digest), size, files, fetched_at
      <name>/<rel path>...      the payload directory engines read
    <key>.lock                  flock: one fetch (or eviction) of the key at a time
    <key>.users/<replica id>    use markers: an entry with any is never evicted
    .staging-<key>/             a fetch in progress, kept across crashes to resume
      .manifest.json            the pins (name; per file size, digest, kind), for peers
      .parts/<n>.part           a file arriving, written unbuffered, hashed again
      .parts/<n>.part.json      on resume; its ETag and source, checked on resume
      <name>/<rel path>         files verified and fsynced, then renamed here
    .evicted-<key>-<pid>/       an entry being deleted (renamed away first)

A file reaches its name only verified (size and sha256) and fsynced; the
marker is written, fsynced, and the staging directory renamed to ``<key>/``
last, so after a power cut an entry is either whole or absent. Use markers are
files rather than held locks because engines outlive the agent process: a
replica's marker stays until its stop is seen. Eviction orders entries by
mtime (touched on every use) and skips any being fetched or used.

Node to node (issue 35, section 4). Each agent serves its cache to the other
agents of its cluster, and a fetch tries peers before the origin::

    key = peer_key(engine_key_secret)              # the cluster's peer credential
    server = PeerServer(cache_root, key)           # server.app: ASGI, under uvicorn
    spec = ArtifactSpec(files, peers=(
        Peer("node-1", "http://10.0.0.1:PORT", peer_headers(key)), ...))
    got = ArtifactCache(cache_root).fetch(spec, user=replica_id, progress=sink)
    got.bytes_by_source                            # {"node-1": ..., "origin": ...}

``PeerServer`` (peer_server.py) answers ``GET``/``HEAD
/v1/artifacts/<key>/files/<rel_path>`` with Range, ETag the pinned digest,
from complete entries, from the verified files of a fetch in progress and
from a file's partial as it grows (so nodes fetching at once form a tree);
401 without the credential, 404 for anything a manifest of the key does not
name; a request for a key whose fetch has not begun yet (nodes started
together) is held up to ``start_wait_s`` first. A peer gets one try: whatever
it does wrong (404, 401, 503, a cut, a stall past
``FetchPolicy.peer_stall_s``, bytes that do not verify) moves on to the next
peer, then the origin, resuming with Range from the bytes kept (wrong ones
are discarded), and that peer is not asked again for the artifact's other
files. ``FetchProgress.source`` names the source in flight.
``spread.choose_peers`` / ``plan_spread`` (pure) pick a node's peers so that
each serves at most ``fanout`` children.

The peer routes are one Starlette app (``PeerServer.app``): run it under
uvicorn on the agent's peer port, or mount it beside other routes.
"""

from worker_agent.fetch.cache import ArtifactCache, FetchedArtifact
from worker_agent.fetch.errors import (
    DiskTooSmall,
    FetchDeadline,
    FetchStalled,
    FileMismatch,
    SourceRefused,
    SourceUnavailable,
)
from worker_agent.fetch.peer_server import PeerServer, peer_headers, peer_key
from worker_agent.fetch.progress import FetchProgress, ProgressSink
from worker_agent.fetch.spec import ArtifactSpec, FetchPolicy, FileSpec, HeadersProvider, Peer

LAYER = "agent"  # this package's layer in the dependency rule: tests/test_layers.py

__all__ = [
    "ArtifactCache",
    "ArtifactSpec",
    "DiskTooSmall",
    "FetchDeadline",
    "FetchPolicy",
    "FetchProgress",
    "FetchStalled",
    "FetchedArtifact",
    "FileMismatch",
    "FileSpec",
    "HeadersProvider",
    "Peer",
    "PeerServer",
    "ProgressSink",
    "SourceRefused",
    "SourceUnavailable",
    "peer_headers",
    "peer_key",
]
