"""What a catalog ``source`` names, parsed strictly: a local path, or a remote
repository the weights are fetched from.

::

    /srv/models/tiny.gguf                 a file or directory on the nodes
    file:///srv/models/tiny.gguf          the same
    hf://ORG/REPO[@REVISION][/FILE]       a Hugging Face Hub repo (or a mirror)
    s3://BUCKET/PREFIX                    an S3-compatible store: the objects under
                                          PREFIX/, or one object (a .gguf)
    modelscope://ORG/REPO[@REVISION]      a ModelScope model repo, at a branch or tag

A revision holds no ``/``: a branch such as ``refs/pr/1`` is written with
``%2F`` (``hf://org/repo@refs%2Fpr%2F1``), as the Hub itself quotes it, so
what follows the repo is never ambiguous between a revision and a file.
Every error is a ``ConfigError`` whose text the caller prefixes with the
field (``models[0].source: ...``).
"""

import posixpath
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from llmgw.errors import ConfigError
from llmgw.types.weights_manifest import relative_path_problem

HF_SCHEME = "hf"
S3_SCHEME = "s3"
MODELSCOPE_SCHEME = "modelscope"
# Recognised, refused at apply until their fetchers exist (none now).
NOT_YET: frozenset[str] = frozenset()

# The Hub's own rule for a namespace or repo name (huggingface_hub
# validate_repo_id), without its legacy unnamespaced ids: ORG/REPO always.
_NAME = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?<![.-])$")
# Git refs: no control characters, spaces, or the characters git refuses.
_REVISION = re.compile(r"^[A-Za-z0-9._/-]{1,255}$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class LocalSource:
    """A normalised absolute path on the nodes."""

    path: str


@dataclass(frozen=True)
class HfSource:
    """A Hub repo, at a revision (None: the repo's default branch), and
    optionally one file of it (a GGUF for llama.cpp)."""

    repo: str
    revision: str | None = None
    file: str | None = None

    def uri(self, revision: str | None = None) -> str:
        """The source as written, at ``revision`` when given."""
        rev = revision or self.revision
        at = f"@{rev.replace('/', '%2F')}" if rev else ""
        return f"{HF_SCHEME}://{self.repo}{at}" + (f"/{self.file}" if self.file else "")


@dataclass(frozen=True)
class S3Source:
    """A bucket and a key prefix ("": the whole bucket), without a trailing
    ``/``: the objects under ``prefix/``, or the one object ``prefix`` names
    (llama.cpp's ``.gguf``). Endpoint and credentials: a storage profile."""

    bucket: str
    prefix: str

    def uri(self) -> str:
        """The source as written."""
        return f"{S3_SCHEME}://{self.bucket}/{self.prefix}"

    @property
    def repo(self) -> str:
        """What a pin records as its repo: ``bucket/prefix``, or ``bucket``."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    @property
    def names_object(self) -> bool:
        """Whether the prefix names one object (a ``.gguf``), not the objects under it."""
        return self.prefix.lower().endswith(".gguf")

    def key(self, path: str) -> str:
        """The object key of a pinned file at ``path`` (relative to the prefix;
        for a source that names one object, that object's base name)."""
        if self.names_object:
            return self.prefix
        return f"{self.prefix}/{path}" if self.prefix else path


@dataclass(frozen=True)
class ModelScopeSource:
    """A ModelScope model repo at a branch or tag (None: its default branch);
    the whole repo, the entry's include/exclude choosing among its files."""

    repo: str
    revision: str | None = None

    def uri(self) -> str:
        """The source as written."""
        at = f"@{self.revision.replace('/', '%2F')}" if self.revision else ""
        return f"{MODELSCOPE_SCHEME}://{self.repo}{at}"


Source = LocalSource | HfSource | S3Source | ModelScopeSource


def parse_source(text: str) -> Source:
    """``text`` parsed, or a ConfigError saying what is wrong with it."""
    if text.startswith("/"):
        return LocalSource(posixpath.normpath(text))
    scheme, sep, rest = text.partition("://")
    if not sep:
        if ":" in text.split("/", 1)[0]:
            raise ConfigError(f"{text!r}: a URL needs scheme://")
        raise ConfigError(f"{text!r} must be an absolute path on the nodes")
    if scheme == "file":
        parts = urlsplit(text)
        path = unquote(parts.path)
        if parts.netloc in ("", "localhost") and path.startswith("/"):
            return LocalSource(posixpath.normpath(path))
        raise ConfigError(f"file URL {text!r} must name an absolute local path")
    if scheme == HF_SCHEME:
        repo, revision, file = _repo_at(text, rest, with_file=True)
        return HfSource(repo, revision, file)
    if scheme == MODELSCOPE_SCHEME:
        repo, revision, _ = _repo_at(text, rest, with_file=False)
        return ModelScopeSource(repo, revision)
    if scheme == S3_SCHEME:
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise ConfigError(f"{text!r}: {bucket!r} is not an S3 bucket name")
        if "?" in rest or "#" in rest or "@" in bucket:
            raise ConfigError(
                f"{text!r}: an s3:// source names a bucket and prefix only; endpoint and"
                " credentials come from a storage profile"
            )
        return S3Source(bucket, _relative(text, prefix.rstrip("/"), "prefix", allow_empty=True))
    raise ConfigError(
        f"scheme {scheme!r} in {text!r} is not a source llmgw knows: use an absolute"
        " path, file://, hf://, s3:// or modelscope://"
    )


def _repo_at(text: str, rest: str, with_file: bool) -> tuple[str, str | None, str | None]:
    """ORG/REPO[@REVISION][/FILE] of ``rest``."""
    if "?" in rest or "#" in rest:
        raise ConfigError(f"{text!r}: no query or fragment in a source")
    org, _, after = rest.partition("/")
    name, _, file = after.partition("/")
    name, at, revision = name.partition("@")
    for part, what in ((org, "organisation"), (name, "repo name")):
        if not _NAME.match(part):
            raise ConfigError(f"{text!r}: {part!r} is not a valid {what} (ORG/REPO)")
    rev: str | None = None
    if at:
        rev = unquote(revision)
        if not _REVISION.match(rev) or ".." in rev or rev.startswith("/") or rev.endswith("/"):
            raise ConfigError(f"{text!r}: {revision!r} is not a revision")
    if file and not with_file:
        raise ConfigError(f"{text!r}: name the repo only (ORG/REPO[@REVISION])")
    path = _relative(text, file, "file", allow_empty=True) if file else None
    return f"{org}/{name}", rev, path


def _relative(text: str, path: str, what: str, allow_empty: bool = False) -> str:
    """``path`` if it is a clean relative path inside the repo."""
    if not path and allow_empty:
        return ""
    problem = relative_path_problem(path)
    if problem:
        raise ConfigError(f"{text!r}: {what} {path!r} {problem}")
    return path
