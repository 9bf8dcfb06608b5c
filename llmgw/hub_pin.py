"""An ``hf://`` source pinned at apply: its revision resolved to the commit,
its files listed with their sizes and digests, and checked against the engine.

Through ``huggingface_hub`` (the Hub's own client), against the endpoint of
the settings: ``model_info(files_metadata=True)`` gives the commit and each
file's size and digest (the LFS sha256, or the git blob id of a small file),
and one file's metadata (a HEAD of its resolve URL) shows whether the token
may read the repo: a gated repo lists its files to anyone.

The token is handed to the client only; no text made here holds it.
"""

from dataclasses import dataclass

import httpx2
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoSibling

from llmgw.engine_files import checkpoint_problem, select
from llmgw.errors import ConfigError
from llmgw.sources import HfSource
from llmgw.types.model import EngineKind
from llmgw.types.weights_manifest import (
    DigestKind,
    ManifestFile,
    SourcePin,
    WeightsManifest,
)

TOKEN_SETTING = "LLMGW_HF_TOKEN"
# The Hub's default branch, what a source without @REVISION follows.
DEFAULT_REVISION = "main"
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Hub:
    """Where the Hub is, and the token ("": none) that reads it."""

    endpoint: str
    token: str = ""

    def __repr__(self) -> str:  # never the token, whoever prints this
        return f"Hub(endpoint={self.endpoint!r}, token={'***' if self.token else ''!r})"


def pin_hf(
    source: HfSource,
    engine: EngineKind,
    include: list[str] | None,
    exclude: list[str],
    hub: Hub,
) -> SourcePin:
    """``source`` resolved to its commit and checked, or a ConfigError saying why not."""
    api = HfApi(endpoint=hub.endpoint)
    token: str | bool = hub.token or False  # False: never a token from HF_TOKEN or ~/.cache
    requested = source.revision or DEFAULT_REVISION
    try:
        info = api.model_info(
            source.repo,
            revision=source.revision,
            files_metadata=True,
            token=token,
            timeout=TIMEOUT_S,
        )
    except Exception as exc:
        raise ConfigError(_why(exc, source, requested, hub)) from None
    commit = info.sha or ""
    if len(commit) != 40:
        raise ConfigError(f"{hub.endpoint} gave no commit for {source.repo}@{requested}")
    chosen = _files(source, engine, include, exclude, info.siblings or [], commit)
    manifest = WeightsManifest(files=tuple(_manifest_file(s) for s in chosen))
    # Listing is public for a gated repo: reading one file says whether we may.
    url = hf_hub_url(source.repo, manifest.files[0].path, revision=commit, endpoint=hub.endpoint)
    try:
        get_hf_file_metadata(url, token=token, timeout=TIMEOUT_S, endpoint=hub.endpoint)
    except Exception as exc:
        raise ConfigError(_why(exc, source, requested, hub)) from None
    return SourcePin(
        scheme="hf", repo=source.repo, requested=requested, revision=commit, manifest=manifest
    )


def _files(
    source: HfSource,
    engine: EngineKind,
    include: list[str] | None,
    exclude: list[str],
    siblings: list[RepoSibling],
    commit: str,
) -> list[RepoSibling]:
    """The files the entry takes, checked against what the engine loads."""
    at = f"{source.repo} at {commit[:12]}"
    if engine is EngineKind.LLAMA_CPP:
        ggufs = sorted(s.rfilename for s in siblings if s.rfilename.lower().endswith(".gguf"))
        if not source.file:
            have = ", ".join(ggufs[:8]) + (", ..." if len(ggufs) > 8 else "")
            raise ConfigError(
                f"llama.cpp serves one GGUF file: name it ({source.uri()}/FILE.gguf); "
                + (f"{at} has {have}" if ggufs else f"{at} has no .gguf file")
            )
        if not source.file.lower().endswith(".gguf"):
            raise ConfigError(f"llama.cpp serves a .gguf file, not {source.file!r}")
    elif source.file:
        raise ConfigError(
            f"{engine.value} loads a whole checkpoint: leave the file out ({source.repo})"
        )
    if source.file:
        if include is not None or exclude:
            raise ConfigError("include and exclude choose among a repo's files: the URI names one")
        named = [s for s in siblings if s.rfilename == source.file]
        if not named:
            raise ConfigError(f"file {source.file!r} not found in {at}")
        return named
    by_name = {s.rfilename: s for s in siblings}
    chosen = [by_name[n] for n in select(by_name, include, exclude)]
    problem = checkpoint_problem([s.rfilename for s in chosen], engine, at)
    if problem:
        raise ConfigError(problem)
    return chosen


def _manifest_file(sibling: RepoSibling) -> ManifestFile:
    try:
        if sibling.lfs is not None:
            return ManifestFile(
                path=sibling.rfilename,
                size=sibling.lfs.size,
                digest=sibling.lfs.sha256,
                digest_kind=DigestKind.SHA256,
            )
        if sibling.size is None or not sibling.blob_id:
            raise ConfigError(f"the Hub gave no size or digest for {sibling.rfilename!r}")
        return ManifestFile(
            path=sibling.rfilename,
            size=sibling.size,
            digest=sibling.blob_id,
            digest_kind=DigestKind.GIT_SHA1,
        )
    except ValueError as exc:  # pydantic's, or ours
        raise ConfigError(f"the Hub's entry for {sibling.rfilename!r} is unusable: {exc}") from None


def _why(exc: Exception, source: HfSource, requested: str, hub: Hub) -> str:
    """What went wrong, for the user: the reason, never the token or a traceback."""
    where = f"{source.repo} on {hub.endpoint}"
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError: it is one
        if not hub.token:
            return f"{where} is gated: reading it needs a token ({TOKEN_SETTING}) with access"
        return f"{where} is gated and the token has no access (accept its terms on the Hub)"
    if isinstance(exc, RepositoryNotFoundError):
        if hub.token:
            return f"repo {where} not found, or the token cannot read it"
        return f"repo {where} not found (a private repo needs a token: {TOKEN_SETTING})"
    if isinstance(exc, RevisionNotFoundError):
        return f"revision {requested!r} not found in {where}"
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"a listed file is not found in {where} at {requested!r}"
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403):
            return f"{where}: forbidden ({status}) with {'the' if hub.token else 'no'} token"
        return f"{where}: the Hub answered {status}"
    if isinstance(exc, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set: the Hub cannot be asked to pin the source"
    if isinstance(exc, httpx2.HTTPError | OSError):
        return f"the Hub at {hub.endpoint} could not be reached ({type(exc).__name__})"
    return f"{where}: {type(exc).__name__}"
