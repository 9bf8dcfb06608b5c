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
      .parts/<n>.part           a file arriving, written unbuffered, hashed again
      .parts/<n>.part.json      on resume; its ETag, checked on resume
      <name>/<rel path>         files verified and fsynced, then renamed here
    .evicted-<key>-<pid>/       an entry being deleted (renamed away first)

A file reaches its name only verified (size and sha256) and fsynced; the
marker is written, fsynced, and the staging directory renamed to ``<key>/``
last, so after a power cut an entry is either whole or absent. Use markers are
files rather than held locks because engines outlive the agent process: a
replica's marker stays until its stop is seen. Eviction orders entries by
mtime (touched on every use) and skips any being fetched or used.
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
from worker_agent.fetch.progress import FetchProgress, ProgressSink
from worker_agent.fetch.spec import ArtifactSpec, FetchPolicy, FileSpec, HeadersProvider

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
    "ProgressSink",
    "SourceRefused",
    "SourceUnavailable",
]
