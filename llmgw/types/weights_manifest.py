"""A remote source pinned at apply: the immutable revision and what it holds.

``llmgw model apply`` resolves a moving revision (``main``) to a commit and
records here each file the engine needs, with its size and digest, in the
catalog entry. A replica started next month fetches the same bytes, and a
node's weights cache keys the files by ``artifact_id()``: equal manifests
are one artifact, whatever source named them.
"""

import hashlib
import json
import re
from enum import StrEnum
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_HEX = re.compile(r"^[0-9a-f]+$")


def relative_path_problem(path: str) -> str:
    """Why ``path`` is not a clean relative POSIX path that stays inside its
    directory (``""``: it is). Files of a manifest are written under a cache
    entry by these names: one that climbs out would write anywhere."""
    if not path:
        return "is empty"
    if path.startswith("/") or "\\" in path or "\x00" in path:
        return "must be relative (no leading /, no backslash)"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "must not hold '..', '.' or empty parts"
    return ""


class DigestKind(StrEnum):
    """What a manifest file's ``digest`` is."""

    # The sha256 of the file's bytes: what the Hub gives for LFS files.
    SHA256 = "sha256"
    # The git blob id (sha1 of ``blob <size>\\0`` + bytes): all the Hub gives
    # for a small file kept in git itself (configs, tokenizers).
    GIT_SHA1 = "git-sha1"
    # The MD5 of the bytes: an S3 object's ETag when uploaded in one part.
    MD5 = "md5"


_DIGEST_LENGTH = {DigestKind.SHA256: 64, DigestKind.GIT_SHA1: 40, DigestKind.MD5: 32}


def digest_length(kind: DigestKind) -> int:
    """Hex digits of a ``kind`` digest."""
    return _DIGEST_LENGTH[kind]


def new_hasher(kind: DigestKind, size: int) -> "hashlib._Hash":
    """A running hash that ends at the ``kind`` digest of a ``size``-byte file:
    a git blob id starts with its header, so the size must be known first."""
    if kind is DigestKind.GIT_SHA1:
        hasher = hashlib.sha1(usedforsecurity=False)
        hasher.update(b"blob %d\x00" % size)
        return hasher
    if kind is DigestKind.MD5:
        return hashlib.md5(usedforsecurity=False)
    return hashlib.sha256()


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data``, as the Hub reports a non-LFS file."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data, usedforsecurity=False).hexdigest()


class ManifestFile(BaseModel):
    """One file of a pinned artifact, by its path relative to the artifact."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int = Field(ge=0)
    digest: str
    digest_kind: DigestKind = DigestKind.SHA256
    # The origin's version of the object, where it keeps versions (an S3
    # VersionId on a versioned bucket): fetched by it, so the bytes cannot
    # change under the pin. Not part of artifact_id: the digest is the content.
    version_id: str | None = Field(default=None, min_length=1, max_length=1024)

    @field_validator("path")
    @classmethod
    def _inside(cls, value: str) -> str:
        problem = relative_path_problem(value)
        if problem:
            raise ValueError(f"file path {value!r} {problem}")
        return value

    @model_validator(mode="after")
    def _digest_shape(self) -> Self:
        if len(self.digest) != _DIGEST_LENGTH[self.digest_kind] or not _HEX.match(self.digest):
            raise ValueError(
                f"{self.path}: {self.digest_kind.value} digest {self.digest!r} is not"
                f" {_DIGEST_LENGTH[self.digest_kind]} lowercase hex digits"
            )
        return self


class WeightsManifest(BaseModel):
    """The files of one artifact, sorted by path, each path once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    files: tuple[ManifestFile, ...] = Field(min_length=1)

    @field_validator("files")
    @classmethod
    def _sorted_once(cls, files: tuple[ManifestFile, ...]) -> tuple[ManifestFile, ...]:
        paths = [f.path for f in files]
        if len(set(paths)) != len(paths):
            raise ValueError("a path is listed twice")
        # One path may not be both a file and a directory of another.
        dirs = {p.rsplit("/", 1)[0] for p in paths if "/" in p}
        if clash := sorted(dirs & set(paths)):
            raise ValueError(f"{clash[0]} is both a file and a directory")
        return tuple(sorted(files, key=lambda f: f.path))

    def total_bytes(self) -> int:
        """What the artifact takes on disk."""
        return sum(f.size for f in self.files)

    def artifact_id(self) -> str:
        """``sha256:`` and the digest of the canonical manifest (sorted paths,
        compact JSON): what a node's cache keys the artifact on."""
        canonical = json.dumps(
            [[f.path, f.size, f.digest_kind.value, f.digest] for f in self.files],
            separators=(",", ":"),
            ensure_ascii=True,
        )
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


# Hex digits of a pinned revision, by scheme.
REVISION_HEX = {"hf": 40, "s3": 64, "modelscope": 64}
LATEST_OBJECTS = "latest"


class SourcePin(BaseModel):
    """A remote source pinned: where from, at which immutable revision, and
    what it holds (``manifest``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The source's scheme (llmgw.sources: "hf", "s3") and repo ("org/name";
    # for s3 "bucket/prefix", the prefix "" for a whole bucket: "bucket").
    scheme: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    # The revision the source asked for ("main", a tag), or the default branch;
    # for s3, which has no revisions, LATEST_OBJECTS: the objects as listed.
    requested: str = Field(min_length=1)
    # The immutable revision, shaped per scheme (REVISION_HEX): a Hub commit
    # (40 hex digits); for s3 the sha256 of the listing pinned (each key, size,
    # ETag and version id), so a changed object is a changed revision; for
    # modelscope, whose revisions are names, the sha256 of the listing pinned
    # (the repo, the name, each path, size and sha256).
    revision: str = Field(pattern=r"^[0-9a-f]{40,64}$")
    manifest: WeightsManifest

    @model_validator(mode="after")
    def _revision_shape(self) -> Self:
        want = REVISION_HEX.get(self.scheme)
        if want is None:
            raise ValueError(f"scheme {self.scheme!r} is not one llmgw pins")
        if len(self.revision) != want:
            raise ValueError(f"a {self.scheme} pin's revision is {want} hex digits")
        return self

    def total_bytes(self) -> int:
        """What the artifact takes on disk."""
        return self.manifest.total_bytes()

    def artifact_id(self) -> str:
        """The manifest's digest (``WeightsManifest.artifact_id``)."""
        return self.manifest.artifact_id()
