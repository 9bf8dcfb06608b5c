"""A ModelScope-compatible server on loopback, for tests that reach no ModelScope.

It answers the ``/api/v1/`` calls ``modelscope_hub`` makes for model repos,
in ModelScope's shapes (every answer wrapped as ``{"Code", "Data", ...}``):

- ``GET /api/v1/models/ORG/REPO/revisions``: ``RevisionMap`` of ``Branches``
  and ``Tags``, each ``{"Revision": NAME}``;
- ``GET /api/v1/models/ORG/REPO/repo/files?Revision=R&Recursive=True``:
  ``Files``, each ``Path``, ``Name``, ``Type`` (``blob``, or ``tree`` for a
  directory), ``Size``, ``Sha256``;
- ``GET /api/v1/models/ORG/REPO/repo?Revision=R&FilePath=P``: the bytes; a
  ``Range`` is answered with 206.

A private repo answers 404 unless the request carries a reader's token, as
``modelscope_hub`` sends it (``Authorization: Bearer`` or the
``m_session_id`` cookie). Revisions are names only, as on ModelScope:
``publish`` points a branch or tag at files on disk. ``served_bytes`` counts
the file bytes sent.
"""

import hashlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class MsRepo:
    """One model repo: each revision name's files (path -> bytes on disk)."""

    branches: dict[str, dict[str, Path]] = field(default_factory=dict)
    tags: dict[str, dict[str, Path]] = field(default_factory=dict)
    private: bool = False
    readers: set[str] = field(default_factory=set)

    def at(self, revision: str) -> dict[str, Path] | None:
        return self.branches.get(revision, self.tags.get(revision))


class ModelScopeServer:
    """Seed with ``publish``, then serve inside ``running()``."""

    def __init__(self) -> None:
        self.repos: dict[str, MsRepo] = {}
        self.url = ""
        self.served_bytes = 0
        self.requests: list[str] = []  # "PATH?QUERY" of each request, in order

    def publish(
        self, repo: str, files: dict[str, Path], revision: str = "master", tag: bool = False
    ) -> None:
        """Point ``revision`` (a branch, or a tag) of ``repo`` at ``files``."""
        entry = self.repos.setdefault(repo, MsRepo())
        (entry.tags if tag else entry.branches)[revision] = dict(files)

    def app(self) -> Starlette:
        base = "/api/v1/models/{org}/{name}"
        return Starlette(
            routes=[
                Route(base + "/revisions", self._revisions),
                Route(base + "/repo/files", self._files),
                Route(base + "/repo", self._download),
            ]
        )

    def _repo(self, request: Request) -> MsRepo | None:
        self.requests.append(f"{request.url.path}?{request.url.query}")
        repo = self.repos.get(f"{request.path_params['org']}/{request.path_params['name']}")
        if repo is None:
            return None
        if repo.private:
            bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
            if not {bearer, request.cookies.get("m_session_id", "")} & repo.readers:
                return None
        return repo

    async def _revisions(self, request: Request) -> Response:
        repo = self._repo(request)
        if repo is None:
            return _error(404, "model not found")
        revision_map = {
            "Branches": [{"Revision": b, "CreatedAt": 0} for b in sorted(repo.branches)],
            "Tags": [{"Revision": t, "CreatedAt": 0} for t in sorted(repo.tags)],
        }
        return _ok({"RevisionMap": revision_map})

    async def _files(self, request: Request) -> Response:
        repo = self._repo(request)
        if repo is None:
            return _error(404, "model not found")
        files = repo.at(request.query_params.get("Revision", "master"))
        if files is None:
            return _error(404, "revision not found")
        listed: list[dict[str, object]] = []
        dirs = {p.rsplit("/", i)[0] for p in files for i in range(1, p.count("/") + 1)}
        for d in sorted(dirs):
            listed.append({"Path": d, "Name": d.rsplit("/", 1)[-1], "Type": "tree", "Size": 0})
        for path, source in sorted(files.items()):
            data = source.read_bytes()
            listed.append(
                {
                    "Path": path,
                    "Name": path.rsplit("/", 1)[-1],
                    "Type": "blob",
                    "Size": len(data),
                    "Sha256": hashlib.sha256(data).hexdigest(),
                }
            )
        return _ok({"Files": listed})

    async def _download(self, request: Request) -> Response:
        repo = self._repo(request)
        if repo is None:
            return _error(404, "model not found")
        files = repo.at(request.query_params.get("Revision", "master"))
        source = (files or {}).get(request.query_params.get("FilePath", ""))
        if source is None:
            return _error(404, "file not found")
        data = source.read_bytes()
        status, headers = 200, {"Accept-Ranges": "bytes"}
        ranged = request.headers.get("range", "")
        if ranged.startswith("bytes="):
            first, _, last = ranged.removeprefix("bytes=").partition("-")
            start = int(first)
            end = int(last) if last else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        self.served_bytes += len(data)
        return Response(data, status_code=status, headers=headers)

    @contextmanager
    def running(self) -> Iterator["ModelScopeServer"]:
        """Serve on a loopback port until the block ends."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # connections wait in the backlog until uvicorn accepts
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
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


def _ok(data: object) -> Response:
    return JSONResponse({"Code": 200, "Data": data, "Message": "success", "Success": True})


def _error(status: int, message: str) -> Response:
    return JSONResponse(
        {"Code": status, "Data": None, "Message": message, "Success": False}, status_code=status
    )
