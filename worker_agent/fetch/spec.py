"""What to fetch (one artifact: a list of files) and how hard to try."""

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from urllib.parse import quote

from llmgw.errors import ConfigError
from llmgw.types.weights_manifest import DigestKind, digest_length, new_hasher

HeadersProvider = Callable[[], Mapping[str, str]]
"""Request headers for a file, asked for at each request (a token may be refreshed).
They may hold a secret: nothing here logs them or puts them in an error."""

KEY_HEX_CHARS = 24
ORIGIN = "origin"


def check_rel_path(rel_path: str) -> str:
    """``rel_path`` if it names a file under a directory (relative, no '..', no
    backslash), else ConfigError: a manifest or a peer's request names no file
    outside its artifact."""
    path = PurePosixPath(rel_path)
    if path.is_absolute() or not path.parts or ".." in path.parts or "\\" in rel_path:
        raise ConfigError(f"file path {rel_path!r} must be relative, without '..'")
    return rel_path


def _no_headers() -> Mapping[str, str]:
    return {}


@dataclass(frozen=True)
class FileSpec:
    """One file of an artifact: where it comes from and what it must be."""

    url: str
    rel_path: str
    size: int
    # What the bytes must hash to, as ``digest_kind`` says: the sha256 the Hub
    # gives for LFS files, the git blob id of small ones, an S3 ETag's MD5.
    digest: str
    digest_kind: DigestKind = DigestKind.SHA256
    headers: HeadersProvider = field(default=_no_headers, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_rel_path(self.rel_path)
        if self.size < 0 or len(self.digest) != digest_length(self.digest_kind):
            raise ConfigError(
                f"{self.rel_path}: a size >= 0 and a hex {self.digest_kind.value} digest are needed"
            )
        object.__setattr__(self, "digest", self.digest.lower())

    def hasher(self) -> "hashlib._Hash":
        """A fresh running hash that ends at ``digest`` for the right bytes."""
        return new_hasher(self.digest_kind, self.size)


@dataclass(frozen=True)
class Peer:
    """Another node of the cluster whose peer server (peer_server.py) may hold
    the artifact: tried, in order, before the origin. Nothing a peer sends is
    trusted: every file is verified against the pin as it arrives.

    ``name`` (the node id) is what progress and ``bytes_by_source`` say;
    ``base_url`` is its peer server (``http://host:port``); ``headers`` carry
    the cluster's peer credential (peer_server.peer_headers).
    """

    name: str
    base_url: str
    headers: HeadersProvider = field(default=_no_headers, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or self.name == ORIGIN:
            raise ConfigError(f"a peer needs a node id other than {ORIGIN!r}")

    def file_url(self, key: str, rel_path: str) -> str:
        return f"{self.base_url.rstrip('/')}/v1/artifacts/{key}/files/{quote(rel_path)}"


@dataclass(frozen=True)
class ArtifactSpec:
    """A set of files fetched, verified and cached together (one pinned manifest).

    ``source`` names the origin in progress and ``bytes_by_source``; ``name`` is
    the payload directory inside the cache entry. ``peers`` are tried first for
    each file, in order; the origin (each file's ``url``) last.
    """

    files: tuple[FileSpec, ...]
    source: str = ORIGIN
    name: str = "files"
    peers: tuple[Peer, ...] = ()

    def __post_init__(self) -> None:
        seen = [f.rel_path for f in self.files]
        if len(set(seen)) != len(seen):
            raise ConfigError("an artifact names one file twice")
        names = [p.name for p in self.peers]
        if self.source in names or len(set(names)) != len(names):
            raise ConfigError("an artifact's sources need distinct names")

    @property
    def key(self) -> str:
        """Content-addressed: the same pinned files are one cache entry, whatever
        URL or source they were fetched from."""
        digest = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.rel_path):
            kind = "" if f.digest_kind is DigestKind.SHA256 else f"{f.digest_kind.value}:"
            digest.update(f"{f.rel_path}\0{f.size}\0{kind}{f.digest}\n".encode())
        return digest.hexdigest()[:KEY_HEX_CHARS]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class FetchPolicy:
    """Retries, stalls and deadlines.

    ``attempts`` bounds the tries of one file at the origin (a digest mismatch
    counts as one; a peer gets one try, its stall window ``peer_stall_s``);
    backoff doubles from ``backoff_s`` up to ``max_backoff_s``; a 429's
    Retry-After is honoured up to ``max_retry_after_s``. ``stall_s``: no byte
    for that long is a stall. ``deadline_s``: the whole artifact's limit (None:
    none).
    """

    attempts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_retry_after_s: float = 300.0
    stall_s: float = 60.0
    # A peer is one try among several sources: a silent one is left sooner.
    peer_stall_s: float = 15.0
    connect_timeout_s: float = 30.0
    deadline_s: float | None = None
    # One read of a body (into one of body.BUFFERS buffers: the memory a fetch
    # holds) and of a partial being hashed again at a resume. 4 MiB measured
    # slower than 1 MiB: eight of them outgrow the CPU caches the copies go through.
    chunk_bytes: int = 2**20
    # Free space kept beyond what is left to fetch.
    disk_margin_bytes: int = 256 * 2**20
    progress_interval_s: float = 1.0
