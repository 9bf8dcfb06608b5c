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

from llmgw.sources import HF_SCHEME, HfSource, S3Source, parse_source
from llmgw.types.weights_manifest import SourcePin
from worker_agent.fetch import ArtifactSpec, FileSpec
from worker_agent.weights import UnsupportedSource

TokenFn = Callable[[], str]
"""The Hub token ("": none), read when a request is made (a mounted secret may rotate)."""


def _no_token() -> str:
    return ""


@dataclass(frozen=True)
class Origins:
    """How this node reaches the origins: the Hub endpoint and its token."""

    hf_endpoint: str = "https://huggingface.co"
    hf_token: TokenFn = field(default=_no_token, repr=False)


@dataclass(frozen=True)
class PinnedArtifact:
    """What to fetch for a pinned source, and what the engine is given: the
    payload directory, or ``file`` in it (one GGUF named by the source)."""

    spec: ArtifactSpec
    file: str | None


def artifact_for(source: str, pin: SourcePin, origins: Origins) -> PinnedArtifact:
    """The files of ``pin`` at their origin, or UnsupportedSource.

    Raises:
        UnsupportedSource: the source is not remote, or not the pin's, or its
            scheme is not fetched by nodes.
    """
    parsed = parse_source(source)
    if isinstance(parsed, HfSource) and pin.scheme == HF_SCHEME:
        if parsed.repo != pin.repo:
            raise UnsupportedSource(f"{source}: pinned to another repo ({pin.repo})")
        return PinnedArtifact(ArtifactSpec(_hf_files(pin, origins), name="files"), parsed.file)
    if isinstance(parsed, S3Source):
        raise UnsupportedSource(f"{source}: nodes cannot fetch s3:// sources yet")
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
