"""The peer server: an agent serves the files of its artifact cache to the other
agents of its cluster, so the origin serves each artifact about once.

``GET``/``HEAD /v1/artifacts/<key>/files/<rel_path>`` answers, with Range
(one range; 206 and Content-Range) and ``ETag`` the file's pinned digest:

- a file of a complete entry (``<key>/<name>/<rel>``);
- a file of a fetch in progress already verified and renamed into
  ``.staging-<key>/<name>/<rel>``, so nodes fetching at once form a tree;
- the partial of a file still arriving (``.staging-<key>/.parts/<n>.part``),
  sent as it grows: its bytes are not verified yet, but nothing a peer sends
  is trusted, since the fetcher verifies every file against its pin; the body
  is cut when the partial stops growing for ``part_wait_s`` or is discarded.

Nodes told to fetch at once ask each other before all have begun: a request
for a key this node does not hold yet waits up to ``start_wait_s`` for its
fetch to begin, and one for a file its fetch has not reached yet up to
``part_wait_s`` (the same key is the same files, so it will come), before a
404. Both stay under the fetcher's ``FetchPolicy.peer_stall_s``.

Only files a manifest of the key names are served (the entry's COMPLETE
marker, the staging manifest), under the cache root once links are resolved:
anything else is a 404, whatever the path says. Every request needs the
cluster's peer credential (``peer_key``), compared in constant time; a
missing or wrong one is a 401. Reads run in worker threads, at most
``max_transfers`` bodies at once (more get a 503 with Retry-After, which a
fetcher takes as "try the next source").
"""

import hashlib
import hmac
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llmgw.errors import ConfigError
from worker_agent.fetch.cache import PARTS, STAGING_MANIFEST, STAGING_PREFIX, part_name
from worker_agent.fetch.entry import MARKER
from worker_agent.fetch.spec import KEY_HEX_CHARS, HeadersProvider, check_rel_path

PEER_KEY_PREFIX = "llmgw-peer-"
FILES_ROUTE = "/v1/artifacts/{key}/files/{rel_path:path}"
_KEY = re.compile(f"[0-9a-f]{{{KEY_HEX_CHARS}}}")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_POLL_S = 0.02


def peer_key(secret: str, scope: str = "peers") -> str:
    """The bearer credential of the peer protocol: HMAC-SHA256 of the cluster's
    engine-key secret (llmgw/engine_keys.py), so every agent derives it with
    no table; ``scope`` may name a narrower audience (one serving node)."""
    if not secret:
        raise ValueError("empty engine-key secret")
    mac = hmac.new(secret.encode(), f"llmgw-peer:{scope}".encode(), hashlib.sha256)
    return PEER_KEY_PREFIX + mac.hexdigest()


def peer_headers(key: str) -> HeadersProvider:
    """The request headers a fetcher sends a peer (``Peer.headers``)."""
    header = {"Authorization": f"Bearer {key}"}

    def headers() -> Mapping[str, str]:
        return header

    return headers


@dataclass(frozen=True)
class _Held:
    """A file the cache can serve: opened, so a rename or an eviction after the
    lookup changes nothing for this answer."""

    fd: int
    size: int
    digest: str
    growing: bool  # a partial still arriving, not a verified file


def _pins(manifest: Path, rel_path: str) -> tuple[str, int, str] | None:
    """(payload name, size, digest) of ``rel_path`` in a marker or staging manifest."""
    try:
        data = json.loads(manifest.read_text())
        name, pin = data["name"], data["files"][rel_path]
        size, digest = pin["size"], pin["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(name, str) and isinstance(size, int) and isinstance(digest, str)):
        return None
    return name, size, digest


def _open_inside(root: Path, path: Path, size: int | None) -> int | None:
    """``path`` opened for reading if it resolves under ``root`` (and has ``size``)."""
    try:
        real = path.resolve(strict=True)
        # A regular file before opening: a FIFO planted in the cache would block the open.
        if not real.is_relative_to(root.resolve()) or not real.is_file():
            return None
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (OSError, RuntimeError):
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        os.close(fd)
        return None
    return fd


def _coming(root: Path, key: str, rel_path: str) -> bool:
    """Whether a fetch of ``key`` here is under way and names ``rel_path``."""
    return _pins(root / f"{STAGING_PREFIX}{key}" / STAGING_MANIFEST, rel_path) is not None


def locate(root: Path, key: str, rel_path: str) -> _Held | None:
    """The file ``rel_path`` of artifact ``key`` as this cache holds it, or None."""
    complete, staging = root / key, root / f"{STAGING_PREFIX}{key}"
    # Complete first, then staging, then complete again: the staging directory
    # may have been renamed to its entry between the two looks.
    for entry, manifest in (
        (complete, complete / MARKER),
        (staging, staging / STAGING_MANIFEST),
        (complete, complete / MARKER),
    ):
        pin = _pins(manifest, rel_path)
        if pin is None:
            continue
        name, size, digest = pin
        fd = _open_inside(root, entry / name / rel_path, size)
        if fd is not None:
            return _Held(fd, size, digest, growing=False)
        if entry is staging:
            fd = _open_inside(root, staging / PARTS / part_name(rel_path), None)
            if fd is not None:
                return _Held(fd, size, digest, growing=True)
    return None


def _range(header: str | None, size: int) -> tuple[int, int, bool] | None:
    """[start, end) asked by a one-range ``Range`` header and whether it is a
    range answer (206); the whole file when absent or not understood (RFC 9110
    lets a server ignore it); None when it cannot be satisfied."""
    match = _RANGE.fullmatch(header or "")
    if match is None:
        return 0, size, False
    start = int(match[1])
    end = min(size, int(match[2]) + 1) if match[2] else size
    if start >= size or end <= start:
        return None
    return start, end, True


class _FileBody(Response):
    """Bytes [start, end) of an open file, read in threads; closes the file and
    frees its transfer slot however the answer ends (a client gone included)."""

    def __init__(
        self,
        held: _Held,
        span: tuple[int, int],
        status: int,
        headers: dict[str, str],
        server: "PeerServer",
    ) -> None:
        super().__init__(status_code=status, headers=headers)
        self._held = held
        self._start, self._end = span
        self._server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            if scope["method"] == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                if await self._body(send):
                    await send({"type": "http.response.body", "body": b""})
                group.cancel_scope.cancel()
        finally:
            os.close(self._held.fd)
            self._server.transfers -= 1

    async def _body(self, send: Send) -> bool:
        """Send the bytes; False when a growing partial stopped (the body is cut,
        which the fetcher takes as a short answer and resumes elsewhere)."""
        offset, idle = self._start, 0.0
        server = self._server
        while offset < self._end:
            want = min(server.chunk_bytes, self._end - offset)
            chunk = await anyio.to_thread.run_sync(
                os.pread, self._held.fd, want, offset, limiter=server.limiter
            )
            if not chunk:
                if not self._held.growing or os.fstat(self._held.fd).st_nlink == 0:
                    return False  # shrunk under us, or a partial discarded: its bytes were wrong
                if idle >= server.part_wait_s:
                    return False
                await anyio.sleep(_POLL_S)
                idle += _POLL_S
                continue
            idle = 0.0
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            offset += len(chunk)
        return True


class PeerServer:
    """The peer server over the cache at ``root``; ``app`` is its ASGI app.

    ``key``: the credential requests must bear (``peer_key``). ``max_transfers``
    bounds the bodies sent at once and the threads reading them;
    ``chunk_bytes`` is one read; ``part_wait_s`` how long a growing partial may
    stay still before its body is cut, and a file of a fetch under way may take
    to begin; ``start_wait_s`` how long a key not held may take to begin.
    """

    def __init__(
        self,
        root: Path,
        key: str,
        *,
        max_transfers: int = 16,
        chunk_bytes: int = 2**20,
        part_wait_s: float = 10.0,
        start_wait_s: float = 3.0,
    ) -> None:
        if not key:
            raise ConfigError("the peer server needs a credential")
        self.root = root
        self._bearer = f"Bearer {key}".encode()
        self.max_transfers = max_transfers
        self.chunk_bytes = chunk_bytes
        self.part_wait_s = part_wait_s
        self.start_wait_s = start_wait_s
        self.transfers = 0
        self.limiter = anyio.CapacityLimiter(max_transfers)
        self.app = Starlette(routes=[Route(FILES_ROUTE, self._file, methods=["GET", "HEAD"])])

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, self._bearer)

    async def _file(self, request: Request) -> Response:
        if not self._authorized(request):
            return Response(status_code=401, headers={"WWW-Authenticate": "Bearer"})
        key, rel_path = request.path_params["key"], request.path_params["rel_path"]
        try:
            check_rel_path(rel_path)
        except ConfigError:
            return Response(status_code=404)
        if not _KEY.fullmatch(key):
            return Response(status_code=404)
        if self.transfers >= self.max_transfers:
            return Response(status_code=503, headers={"Retry-After": "1"})
        self.transfers += 1  # taken before the lookup's await; the body frees it
        try:
            held = await self._wait_for(key, rel_path)
        except BaseException:
            self.transfers -= 1
            raise
        if held is None:
            self.transfers -= 1
            return Response(status_code=404)
        span = _range(request.headers.get("range"), held.size)
        headers = {"ETag": held.digest, "Accept-Ranges": "bytes"}
        if span is None:
            self.transfers -= 1
            os.close(held.fd)
            headers["Content-Range"] = f"bytes */{held.size}"
            return Response(status_code=416, headers=headers)
        start, end, partial = span
        headers["Content-Length"] = str(end - start)
        if partial:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{held.size}"
        return _FileBody(held, (start, end), 206 if partial else 200, headers, self)

    async def _wait_for(self, key: str, rel_path: str) -> _Held | None:
        """``locate``, polled while the fetch of ``key`` may be about to begin
        (``start_wait_s``) or to reach the file (``part_wait_s`` in all)."""
        started = anyio.current_time()
        while True:
            held = await anyio.to_thread.run_sync(locate, self.root, key, rel_path)
            if held is not None:
                return held
            coming = await anyio.to_thread.run_sync(_coming, self.root, key, rel_path)
            waited = anyio.current_time() - started
            if waited >= (self.part_wait_s if coming else self.start_wait_s):
                return None
            await anyio.sleep(_POLL_S * 5)
