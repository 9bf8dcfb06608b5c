"""Where a pinned remote artifact's files come from: the origin each scheme names.

``model apply`` pinned the source (llmgw/types/weights_manifest.py SourcePin:
the commit and each file's size and digest); here a node turns that pin into
the fetch library's ``ArtifactSpec``, one URL per file at the pinned revision,
never at a moving branch. The fetch verifies every byte against the pin, so a
mirror, a proxy or a peer may serve the files: none is trusted.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from huggingface_hub import hf_hub_url

from llmgw.errors import ConfigError
from llmgw.modelscope_pin import auth_headers, file_url, gguf_of
from llmgw.sources import (
    HF_SCHEME,
    MODELSCOPE_SCHEME,
    S3_SCHEME,
    HfSource,
    ModelScopeSource,
    S3Source,
    parse_source,
)
from llmgw.storage_profiles import DEFAULT_PROFILE, StorageProfile, profile_problem
from llmgw.types.weights_manifest import SourcePin
from worker_agent.fetch import ArtifactSpec, FileSpec
from worker_agent.fetch.s3_origin import DEFAULT_EXPIRES_S, s3_file_specs
from worker_agent.weights import UnsupportedSource

TokenFn = Callable[[], str]
"""The Hub token ("": none), read when a request is made (a mounted secret may rotate)."""


def _no_token() -> str:
    return ""


@dataclass(frozen=True)
class Origins:
    """How this node reaches the origins: the Hub endpoint and its token; the
    storage profiles of s3:// sources (LLMGW_STORAGE_PROFILES) and how long
    their presigned URLs last (longer than a fetch, retries included); ModelScope
    and its token, for modelscope:// sources."""

    hf_endpoint: str = "https://huggingface.co"
    hf_token: TokenFn = field(default=_no_token, repr=False)
    storage_profiles: Mapping[str, StorageProfile] = field(default_factory=dict, repr=False)
    s3_url_expires_s: int = DEFAULT_EXPIRES_S
    modelscope_endpoint: str = "https://modelscope.cn"
    modelscope_token: TokenFn = field(default=_no_token, repr=False)


@dataclass(frozen=True)
class PinnedArtifact:
    """What to fetch for a pinned source, and what the engine is given: the
    payload directory, or ``file`` in it (one GGUF named by the source)."""

    spec: ArtifactSpec
    file: str | None


def artifact_for(
    source: str, pin: SourcePin, origins: Origins, storage_profile: str | None = None
) -> PinnedArtifact:
    """The files of ``pin`` at their origin, or UnsupportedSource.
    ``storage_profile``: the entry's (ModelSpec.storage_profile), for s3://.

    Raises:
        UnsupportedSource: the source is not remote, or not the pin's, or its
            scheme is not fetched by nodes, or its storage profile is not here.
    """
    parsed = parse_source(source)
    if isinstance(parsed, HfSource) and pin.scheme == HF_SCHEME:
        if parsed.repo != pin.repo:
            raise UnsupportedSource(f"{source}: pinned to another repo ({pin.repo})")
        return PinnedArtifact(ArtifactSpec(_hf_files(pin, origins), name="files"), parsed.file)
    if isinstance(parsed, ModelScopeSource) and pin.scheme == MODELSCOPE_SCHEME:
        if parsed.repo != pin.repo:
            raise UnsupportedSource(f"{source}: pinned to another repo ({pin.repo})")
        spec = ArtifactSpec(_modelscope_files(pin, origins), name="files")
        return PinnedArtifact(spec, gguf_of(pin))
    if isinstance(parsed, S3Source) and pin.scheme == S3_SCHEME:
        return _s3_artifact(source, parsed, pin, origins, storage_profile)
    raise UnsupportedSource(f"{source}: not a remote source nodes fetch (pin: {pin.scheme})")


def _hf_files(pin: SourcePin, origins: Origins) -> tuple[FileSpec, ...]:
    endpoint = origins.hf_endpoint.rstrip("/")

    def headers() -> Mapping[str, str]:
        # Sent to the endpoint only: httpx drops Authorization on a redirect
        # to another host (the Hub's LFS files redirect to a CDN).
        token = origins.hf_token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    return tuple(
        FileSpec(
            hf_hub_url(pin.repo, f.path, revision=pin.revision, endpoint=endpoint),
            f.path,
            f.size,
            f.digest,
            f.digest_kind,
            headers=headers,
        )
        for f in pin.manifest.files
    )


def _modelscope_files(pin: SourcePin, origins: Origins) -> tuple[FileSpec, ...]:
    # ModelScope has no commit: the URL names the pinned branch or tag, and the
    # fetch's sha256 check refuses a file changed under that name since.
    endpoint = origins.modelscope_endpoint.rstrip("/")

    def headers() -> Mapping[str, str]:
        return auth_headers(origins.modelscope_token())

    return tuple(
        FileSpec(
            file_url(endpoint, pin.repo, pin.requested, f.path),
            f.path,
            f.size,
            f.digest,
            f.digest_kind,
            headers=headers,
        )
        for f in pin.manifest.files
    )


def _s3_artifact(
    source: str, parsed: S3Source, pin: SourcePin, origins: Origins, name: str | None
) -> PinnedArtifact:
    if parsed.repo != pin.repo:
        raise UnsupportedSource(f"{source}: pinned to another prefix ({pin.repo})")
    problem = profile_problem(dict(origins.storage_profiles), name)
    if problem:
        raise UnsupportedSource(f"{source}: storage_profile: {problem} on this node")
    profile = origins.storage_profiles[name or DEFAULT_PROFILE]
    try:
        files = s3_file_specs(parsed, pin, profile, expires_s=origins.s3_url_expires_s)
    except OSError as exc:
        raise UnsupportedSource(
            f"{source}: storage profile {name or DEFAULT_PROFILE!r}: its secret_access_key_file"
            f" cannot be read ({exc.strerror})"
        ) from None
    except ConfigError as exc:
        raise UnsupportedSource(str(exc)) from None
    # One named object (a .gguf): the engine gets that file of the payload.
    file = pin.manifest.files[0].path if parsed.names_object else None
    return PinnedArtifact(ArtifactSpec(files, name="files"), file)
