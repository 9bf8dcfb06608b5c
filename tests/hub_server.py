"""A Hugging Face Hub-compatible server on loopback, for tests that reach no hub.

It answers what ``huggingface_hub`` asks of the Hub for model repos, with the
Hub's own shapes and headers, so the code under test talks to it through the
real client:

- ``GET /api/models/ORG/REPO[/revision/REV]`` (``model_info``): the commit
  ``sha`` and ``siblings``, with ``?blobs=true`` each one's ``size`` and
  ``blobId`` and, for an LFS file, ``lfs: {size, sha256, pointerSize}``;
- ``GET /api/models/ORG/REPO/tree/REV[/PATH]`` (``list_repo_tree``);
- ``HEAD``/``GET /ORG/REPO/resolve/REV/PATH``: ``X-Repo-Commit``, ``ETag``
  (the git blob id, or the sha256 of an LFS file), ``X-Linked-Etag`` and
  ``X-Linked-Size`` for LFS files, ``Accept-Ranges``; a ``Range`` is answered
  with 206;
- errors as the Hub gives them, by ``X-Error-Code``: ``RepoNotFound`` (also for
  a private repo without a token that reads it), ``GatedRepo`` (a gated repo's
  files without such a token; its listing is public, as on the Hub),
  ``RevisionNotFound``, ``EntryNotFound``.

Repos are seeded from files on disk (``commit``), each commit moving its
branch; ``served_bytes`` counts the file bytes sent, for tests of fetchers.
Tests set ``HF_HUB_DISABLE_XET=1``: this server speaks no Xet.
"""

import asyncio
import hashlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmgw.types.weights_manifest import git_blob_sha1

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
LFS_MIN_BYTES = 10 * 1024
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class HubFile:
    """One file of a commit, its bytes on disk."""

    path: str
    source: Path
    size: int
    sha256: str
    blob_id: str
    lfs: bool

    @classmethod
    def of(cls, path: str, source: Path) -> "HubFile":
        size = source.stat().st_size
        lfs = path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES
        with source.open("rb") as f:  # read in chunks: the benchmark's files are GiB
            sha256 = hashlib.file_digest(f, "sha256").hexdigest()
        # An LFS file's git blob is its pointer; the Hub reports that blob's id.
        blob = _pointer(sha256, size) if lfs else source.read_bytes()
        return cls(path, source, size, sha256, git_blob_sha1(blob), lfs)

    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


def _pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
    ).encode()


@dataclass
class HubRepo:
    """Branches and tags to commits, and each commit's files."""

    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    readers: set[str] = field(default_factory=set)  # tokens that may read it


class HubServer:
    """The server and its repos; ``url`` once started (``running``)."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.served_bytes = 0
        self.requests: list[tuple[str, str]] = []  # (method, path), in order
        self.url = ""
        # Seconds slept after each 64 KiB of a file's body: a slow link, so a
        # fetch's progress can be watched (0: as fast as it goes).
        self.chunk_delay_s = 0.0
        self._lock = threading.Lock()

    def commit(self, repo: str, files: dict[str, Path], branch: str = "main") -> str:
        """A new commit of ``files`` on ``branch`` of ``repo`` (made when new); its sha."""
        hub_repo = self.repos.setdefault(repo, HubRepo())
        entries = {p: HubFile.of(p, src) for p, src in sorted(files.items())}
        parent = hub_repo.refs.get(branch, "")
        text = parent + "".join(f"{f.path}:{f.sha256}\n" for f in entries.values())
        sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
        hub_repo.commits[sha] = entries
        hub_repo.refs[branch] = sha
        return sha

    # -- the Hub's API ---------------------------------------------------

    def _repo(self, request: Request) -> tuple[str, HubRepo | Response]:
        repo_id = f"{request.path_params['org']}/{request.path_params['name']}"
        repo = self.repos.get(repo_id)
        token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if repo is None or (repo.private and token not in repo.readers):
            # The Hub answers 401 without a token, so as not to tell private from missing.
            return repo_id, _error(404 if token else 401, "RepoNotFound", "Repository not found")
        return repo_id, repo

    def _commit(self, repo: HubRepo, revision: str) -> str | Response:
        sha = repo.refs.get(revision, revision if revision in repo.commits else "")
        return sha or _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    async def model_info(self, request: Request) -> Response:
        repo_id, repo = self._repo(request)
        if isinstance(repo, Response):
            return repo
        sha = self._commit(repo, request.path_params.get("revision", "main"))
        if isinstance(sha, Response):
            return sha
        blobs = request.query_params.get("blobs", "").lower() == "true"
        siblings = [_sibling(f, blobs) for f in repo.commits[sha].values()]
        return JSONResponse(
            {
                "_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": sha,
                "private": repo.private, "gated": "auto" if repo.gated else False,
                "disabled": False, "siblings": siblings, "tags": [],
            }
        )  # fmt: skip

    async def tree(self, request: Request) -> Response:
        _, repo = self._repo(request)
        if isinstance(repo, Response):
            return repo
        sha = self._commit(repo, request.path_params["revision"])
        if isinstance(sha, Response):
            return sha
        under = request.path_params.get("path", "").strip("/")
        prefix = f"{under}/" if under else ""
        files = [f for f in repo.commits[sha].values() if f.path.startswith(prefix)]
        if under and not files:
            return _error(404, "EntryNotFound", f"{under} does not exist")
        return JSONResponse([_tree_entry(f) for f in files])

    async def resolve(self, request: Request) -> Response:
        with self._lock:
            self.requests.append((request.method, request.url.path))
        _, repo = self._repo(request)
        if isinstance(repo, Response):
            return repo
        token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if repo.gated and token not in repo.readers:
            return _error(403 if token else 401, "GatedRepo", "Access to this repo is restricted")
        sha = self._commit(repo, request.path_params["revision"])
        if isinstance(sha, Response):
            return sha
        hub_file = repo.commits[sha].get(request.path_params["path"])
        if hub_file is None:
            return _error(404, "EntryNotFound", "Entry not found")
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{hub_file.etag()}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if hub_file.lfs:
            headers["X-Linked-Etag"] = f'"{hub_file.sha256}"'
            headers["X-Linked-Size"] = str(hub_file.size)
        start, end = 0, hub_file.size
        status = 200
        wanted = request.headers.get("range", "")
        if wanted.startswith("bytes="):
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start = int(first or 0)
            end = min(int(last) + 1, hub_file.size) if last else hub_file.size
            if start >= hub_file.size:
                headers["Content-Range"] = f"bytes */{hub_file.size}"
                return Response(status_code=416, headers=headers)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{hub_file.size}"
        headers["Content-Length"] = str(end - start)
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        if self.chunk_delay_s:
            return StreamingResponse(
                self._trickle(request, hub_file.source, start, end),
                status_code=status,
                headers=headers,
            )
        if end - start <= _CHUNK:
            with hub_file.source.open("rb") as f:
                f.seek(start)
                body = f.read(end - start)
            with self._lock:
                self.served_bytes += len(body)
            return Response(body, status_code=status, headers=headers)
        # Large files stream from disk (the fetch benchmark's GiB files).
        return StreamingResponse(
            self._stream(request, hub_file.source, start, end), status_code=status, headers=headers
        )

    async def _stream(
        self, request: Request, source: Path, start: int, end: int
    ) -> AsyncIterator[bytes]:
        with source.open("rb") as f:
            f.seek(start)
            # A client gone stops the body: uvicorn would take the rest and drop
            # it, and served_bytes would count bytes never sent.
            while (
                start < end
                and not await request.is_disconnected()
                and (chunk := f.read(min(4 * _CHUNK, end - start)))
            ):
                start += len(chunk)
                with self._lock:
                    self.served_bytes += len(chunk)
                yield chunk

    async def _trickle(
        self, request: Request, source: Path, start: int, end: int
    ) -> AsyncIterator[bytes]:
        step = 64 * 1024
        with source.open("rb") as f:
            f.seek(start)
            while (
                start < end
                and not await request.is_disconnected()
                and (chunk := f.read(min(step, end - start)))
            ):
                start += len(chunk)
                with self._lock:
                    self.served_bytes += len(chunk)
                yield chunk
                await asyncio.sleep(self.chunk_delay_s)

    def app(self) -> Starlette:
        repo = "/{org}/{name}"
        return Starlette(
            routes=[
                Route(f"/api/models{repo}", self.model_info),
                Route(f"/api/models{repo}/revision/{{revision:path}}", self.model_info),
                Route(f"/api/models{repo}/tree/{{revision}}", self.tree),
                Route(f"/api/models{repo}/tree/{{revision}}/{{path:path}}", self.tree),
                Route(
                    f"{repo}/resolve/{{revision}}/{{path:path}}",
                    self.resolve,
                    methods=["GET", "HEAD"],
                ),
            ]
        )

    @contextmanager
    def running(self, host: str = "127.0.0.1") -> Iterator["HubServer"]:
        """Serve on a free port of ``host`` (loopback; a test bed's root
        address for its hosts) until the block ends."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(64)  # connections wait in the backlog until uvicorn accepts
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse(
        {"error": message},
        status_code=status,
        headers={"X-Error-Code": code, "X-Error-Message": message},
    )


def _sibling(f: HubFile, blobs: bool) -> dict[str, object]:
    entry: dict[str, object] = {"rfilename": f.path}
    if blobs:
        entry["size"] = f.size
        entry["blobId"] = f.blob_id
        if f.lfs:
            entry["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
    return entry


def _tree_entry(f: HubFile) -> dict[str, object]:
    entry: dict[str, object] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
    if f.lfs:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
    return entry
