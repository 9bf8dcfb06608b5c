"""A ``modelscope://`` source pinned at apply: its revision checked, its files
listed with their sizes and sha256, and checked against the engine.

Through ModelScope's ``/api/v1/`` API (what the ``modelscope_hub`` client
calls), with httpx, against the endpoint of the settings; every answer is
wrapped as ``{"Data": ...}``:

- ``GET models/ORG/REPO/revisions``: the branches and tags (``RevisionMap``);
- ``GET models/ORG/REPO/repo/files?Revision=R&Recursive=True``: each file's
  ``Path``, ``Type`` (``blob`` or ``tree``), ``Size`` and ``Sha256``;
- ``GET models/ORG/REPO/repo?Revision=R&FilePath=P``: the bytes (a node's fetch).

ModelScope names no commit: a revision is a branch or tag name. What is pinned
is that name and each file's size and sha256; the pin's ``revision`` is the
sha256 of the listing pinned, so a changed file is a changed pin, and a node
fetches by the name but verifies every byte against the digests (a file moved
since fails its fetch rather than serving other weights).

The token goes out as ``modelscope_hub`` sends it (``Authorization: Bearer``
and the ``m_session_id`` cookie); no text made here holds it.
"""

import hashlib
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from llmgw.engine_files import checkpoint_problem, select
from llmgw.errors import ConfigError
from llmgw.sources import MODELSCOPE_SCHEME, ModelScopeSource
from llmgw.types.model import EngineKind
from llmgw.types.weights_manifest import DigestKind, ManifestFile, SourcePin, WeightsManifest

TOKEN_SETTING = "LLMGW_MODELSCOPE_TOKEN"
# ModelScope's default branch, what a source without @REVISION follows.
DEFAULT_REVISION = "master"
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ModelScope:
    """Where ModelScope is, and the token ("": none) that reads it."""

    endpoint: str = "https://modelscope.cn"
    token: str = ""

    def __repr__(self) -> str:  # never the token, whoever prints this
        return f"ModelScope(endpoint={self.endpoint!r}, token={'***' if self.token else ''!r})"


def auth_headers(token: str) -> dict[str, str]:
    """What ``modelscope_hub`` sends for ``token`` ({}: none). Safe through a
    redirect to a CDN: httpx drops Authorization leaving the origin, and a
    Cookie header on every redirect."""
    if not token:
        return {}
    return {"Authorization": f"Bearer {token}", "Cookie": f"m_session_id={token}"}


def api_base(endpoint: str, repo: str) -> str:
    """The API root of one model repo."""
    org, _, name = repo.partition("/")
    return f"{endpoint.rstrip('/')}/api/v1/models/{quote(org, safe='')}/{quote(name, safe='')}"


def file_url(endpoint: str, repo: str, revision: str, path: str) -> str:
    """Where the bytes of ``path`` at ``revision`` (a branch or tag) are downloaded."""
    query = f"Revision={quote(revision, safe='')}&FilePath={quote(path, safe='')}"
    return f"{api_base(endpoint, repo)}/repo?{query}"


def pin_modelscope(
    source: ModelScopeSource,
    engine: EngineKind,
    include: list[str] | None,
    exclude: list[str],
    hub: ModelScope,
) -> SourcePin:
    """``source`` listed, checked and pinned, or a ConfigError saying why not."""
    requested = source.revision or DEFAULT_REVISION
    where = f"{source.repo} on {hub.endpoint}"
    base = api_base(hub.endpoint, source.repo)
    with httpx.Client(headers=auth_headers(hub.token), timeout=TIMEOUT_S) as client:
        revisions = _data(client, f"{base}/revisions", {}, source, hub)
        if requested not in _names(revisions):
            raise ConfigError(f"revision {requested!r} not found in {where}")
        params = {"Revision": requested, "Recursive": "True"}
        listing = _data(client, f"{base}/repo/files", params, source, hub)
    blobs = _blobs(listing, where)
    chosen = _chosen(source, engine, include, exclude, blobs, f"{source.repo}@{requested}")
    try:
        manifest = WeightsManifest(files=tuple(blobs[p] for p in chosen))
    except ValueError as exc:
        raise ConfigError(f"{where}: its files make no artifact: {exc}") from None
    canonical = json.dumps(
        [source.repo, requested, [[f.path, f.size, f.digest] for f in manifest.files]],
        separators=(",", ":"),
    )
    return SourcePin(
        scheme=MODELSCOPE_SCHEME,
        repo=source.repo,
        requested=requested,
        revision=hashlib.sha256(canonical.encode()).hexdigest(),
        manifest=manifest,
    )


def gguf_of(pin: SourcePin) -> str | None:
    """The one GGUF file of a llama.cpp pin (the engine's file), else None."""
    files = pin.manifest.files
    return files[0].path if len(files) == 1 and files[0].path.lower().endswith(".gguf") else None


def _data(
    client: httpx.Client,
    url: str,
    params: dict[str, str],
    source: ModelScopeSource,
    hub: ModelScope,
) -> Any:
    """The ``Data`` of one answer, or a ConfigError naming what went wrong."""
    where = f"{source.repo} on {hub.endpoint}"
    try:
        answer = client.get(url, params=params)
    except httpx.HTTPError as exc:
        raise ConfigError(
            f"ModelScope at {hub.endpoint} could not be reached ({type(exc).__name__})"
        ) from None
    if answer.status_code == 404:
        if hub.token:
            raise ConfigError(f"repo {where} not found, or the token cannot read it")
        raise ConfigError(f"repo {where} not found (a private repo needs a token: {TOKEN_SETTING})")
    if answer.status_code in (401, 403):
        token = "the" if hub.token else "no"
        raise ConfigError(f"{where}: forbidden ({answer.status_code}) with {token} token")
    if answer.status_code != 200:
        raise ConfigError(f"{where}: ModelScope answered {answer.status_code}")
    try:
        return answer.json()["Data"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{where}: ModelScope's answer has no Data") from None


def _names(revisions: Any) -> set[str]:
    """The branch and tag names of a ``revisions`` answer."""
    found: set[str] = set()
    revision_map = revisions.get("RevisionMap", {}) if isinstance(revisions, dict) else {}
    for kind in ("Branches", "Tags"):
        for entry in revision_map.get(kind) or []:
            if isinstance(entry, dict) and isinstance(entry.get("Revision"), str):
                found.add(entry["Revision"])
    return found


def _blobs(listing: Any, where: str) -> dict[str, ManifestFile]:
    """Each file (not directory) of a listing, by path, as a manifest file."""
    files = listing.get("Files") if isinstance(listing, dict) else None
    if not isinstance(files, list):
        raise ConfigError(f"{where}: ModelScope listed no Files")
    blobs: dict[str, ManifestFile] = {}
    for entry in files:
        if not isinstance(entry, dict) or entry.get("Type") != "blob":
            continue
        path = str(entry.get("Path", ""))
        try:
            blobs[path] = ManifestFile(
                path=path,
                size=entry.get("Size"),
                digest=str(entry.get("Sha256") or "").lower(),
                digest_kind=DigestKind.SHA256,
            )
        except ValueError as exc:  # pydantic's: a missing size or digest, a bad path
            raise ConfigError(
                f"{where}: ModelScope's entry for {path!r} is unusable: {exc}"
            ) from None
    return blobs


def _chosen(
    source: ModelScopeSource,
    engine: EngineKind,
    include: list[str] | None,
    exclude: list[str],
    blobs: dict[str, ManifestFile],
    at: str,
) -> list[str]:
    """The paths the entry takes, checked against what the engine loads. A
    modelscope:// URI names a repo, not a file: llama.cpp's one GGUF is the one
    the include patterns leave (``include: [m-Q4_K_M.gguf]``)."""
    paths = sorted(blobs)
    if engine is EngineKind.LLAMA_CPP:
        ggufs = [p for p in paths if p.lower().endswith(".gguf")]
        chosen = select(ggufs, ["*.gguf"] if include is None else include, exclude)
        if len(chosen) == 1:
            return chosen
        have = ", ".join(ggufs[:8]) + (", ..." if len(ggufs) > 8 else "")
        if not ggufs:
            raise ConfigError(f"llama.cpp serves one GGUF file: {at} has no .gguf file")
        raise ConfigError(
            f"llama.cpp serves one GGUF file: {len(chosen)} of {at}'s are left by include/exclude"
            f" (it has {have}); name one with include: [FILE.gguf]"
        )
    chosen = select(paths, include, exclude)
    problem = checkpoint_problem(chosen, engine, at)
    if problem:
        raise ConfigError(problem)
    return chosen
