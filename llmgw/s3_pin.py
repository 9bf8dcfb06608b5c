"""An ``s3://`` source pinned at apply: its objects listed, each one's size,
digest and version recorded, and checked against the engine.

S3 has no commit: what is pinned is each object as HeadObject shows it now,
its ``VersionId`` when the bucket keeps versions (a node then fetches that
version, whatever is written over the key later), and its digest:

- a plain ETag (one-part upload, not KMS- or customer-key-encrypted) is the
  MD5 of the bytes: ``md5``;
- otherwise (a multipart ETag ``"...-N"``, or an encrypted object) the ETag is
  no digest of the bytes, and neither is a multipart object's
  ``ChecksumSHA256`` (a checksum of the parts' checksums, ``COMPOSITE``). The
  whole object's sha256 is taken from its ``ChecksumSHA256`` when that is of
  type ``FULL_OBJECT``, else from the user metadata ``sha256``
  (``x-amz-meta-sha256``: ``aws s3 cp --metadata sha256=HEX``), else the file
  is refused, naming it: reading every byte at apply to hash it would take as
  long as the fetch itself.

The pin's ``revision`` is the sha256 of what was pinned (bucket, prefix and
each object's key, size, ETag and version), so a changed object is a changed
pin. The client comes from a storage profile (llmgw/storage_profiles.py); no
text made here holds a credential.
"""

import base64
import binascii
import hashlib
import json
import posixpath
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from llmgw.engine_files import checkpoint_problem, select
from llmgw.errors import ConfigError
from llmgw.sources import S3Source
from llmgw.types.model import EngineKind
from llmgw.types.weights_manifest import (
    LATEST_OBJECTS,
    DigestKind,
    ManifestFile,
    SourcePin,
    WeightsManifest,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import HeadObjectOutputTypeDef, ObjectTypeDef

# A prefix with more objects than this is refused: narrow it to one checkpoint.
MAX_OBJECTS = 10_000
PAGE_SIZE = 1000  # S3's own most keys per ListObjectsV2 page
SHA256_METADATA = "sha256"
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DENIED = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "403",
    }
)
_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})


class S3Store:
    """One store, as a storage profile reaches it: the client and, for
    messages, where it is and the profile's name."""

    def __init__(self, client: "S3Client", where: str, profile: str) -> None:
        self.client = client
        self.where = where
        self.profile = profile

    def __repr__(self) -> str:  # the client holds the credentials
        return f"S3Store(where={self.where!r}, profile={self.profile!r})"


def pin_s3(
    source: S3Source,
    engine: EngineKind,
    include: list[str] | None,
    exclude: list[str],
    store: S3Store,
) -> SourcePin:
    """``source`` listed, checked and pinned, or a ConfigError saying why not."""
    try:
        heads = _chosen(source, engine, include, exclude, store)
        files = [_manifest_file(path, key, head) for path, key, head in heads]
    except ConfigError:
        raise
    except Exception as exc:  # botocore's, named by _why
        raise ConfigError(_why(exc, source, store)) from None
    try:
        manifest = WeightsManifest(files=tuple(files))
    except ValueError as exc:
        raise ConfigError(f"{source.uri()}: its objects make no artifact: {exc}") from None
    listing = [
        [path, head["ContentLength"], head["ETag"], head.get("VersionId")]
        for path, _, head in sorted(heads)
    ]
    canonical = json.dumps([source.bucket, source.prefix, listing], separators=(",", ":"))
    return SourcePin(
        scheme="s3",
        repo=source.repo,
        requested=LATEST_OBJECTS,
        revision=hashlib.sha256(canonical.encode()).hexdigest(),
        manifest=manifest,
    )


def _chosen(
    source: S3Source,
    engine: EngineKind,
    include: list[str] | None,
    exclude: list[str],
    store: S3Store,
) -> list[tuple[str, str, "HeadObjectOutputTypeDef"]]:
    """(relative path, key, HeadObject) of each object the entry takes."""
    names_gguf = source.names_object
    if engine is EngineKind.LLAMA_CPP:
        if not names_gguf:
            under = [k for k, _ in _listed(source, store) if k.lower().endswith(".gguf")]
            have = ", ".join(under[:8]) + (", ..." if len(under) > 8 else "")
            raise ConfigError(
                f"llama.cpp serves one GGUF file: name its object ({source.uri()}/FILE.gguf); "
                + (f"there are {have}" if under else f"no .gguf object under {source.uri()}/")
            )
        if include is not None or exclude:
            raise ConfigError(
                "include and exclude choose among a prefix's objects: the URI names one"
            )
        # Listing first: a missing bucket or a key that may not list say so here.
        next(_pages(store, source.bucket, source.prefix), None)
        key = source.prefix
        return [(posixpath.basename(key), key, _head(store, source.bucket, key))]
    if names_gguf:
        raise ConfigError(
            f"{engine.value} loads a whole checkpoint: name its prefix, not a .gguf"
            f" ({source.uri()})"
        )
    listed = dict(_listed(source, store))
    if not listed:
        raise ConfigError(f"no objects under {source.uri()}/ on {store.where}")
    chosen = select(sorted(listed), include, exclude)
    problem = checkpoint_problem(chosen, engine, source.uri())
    if problem:
        raise ConfigError(problem)
    return [(p, source.key(p), _head(store, source.bucket, source.key(p))) for p in chosen]


def _listed(source: S3Source, store: S3Store) -> Iterator[tuple[str, int]]:
    """(path relative to the prefix, size) of each object under ``prefix/``."""
    base = f"{source.prefix}/" if source.prefix else ""
    count = 0
    for page in _pages(store, source.bucket, base):
        for entry in page:
            key = entry.get("Key", "")
            if key.endswith("/"):  # a folder marker, no file
                continue
            count += 1
            if count > MAX_OBJECTS:
                raise ConfigError(
                    f"more than {MAX_OBJECTS} objects under {source.uri()}/: name the"
                    " prefix of one checkpoint"
                )
            yield key[len(base) :], entry.get("Size", 0)


def _pages(store: S3Store, bucket: str, prefix: str) -> Iterator[list["ObjectTypeDef"]]:
    paginator = store.client.get_paginator("list_objects_v2")
    pages = paginator.paginate(
        Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": PAGE_SIZE}
    )
    for page in pages:
        yield page.get("Contents", [])


def _head(store: S3Store, bucket: str, key: str) -> "HeadObjectOutputTypeDef":
    try:
        return store.client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except Exception as exc:
        if _code(exc) in _NOT_FOUND:
            raise ConfigError(f"object {key!r} not found in bucket {bucket!r}") from None
        raise


def _manifest_file(path: str, key: str, head: "HeadObjectOutputTypeDef") -> ManifestFile:
    digest, kind = _digest(key, head)
    try:
        return ManifestFile(
            path=path,
            size=head["ContentLength"],
            digest=digest,
            digest_kind=kind,
            version_id=head.get("VersionId") or None,
        )
    except ValueError as exc:
        raise ConfigError(f"object {key!r} is unusable: {exc}") from None


def _digest(key: str, head: "HeadObjectOutputTypeDef") -> tuple[str, DigestKind]:
    """The object's digest and its kind, by the rule in the module's docstring."""
    etag = head.get("ETag", "").strip('"').lower()
    encrypted = bool(head.get("SSECustomerAlgorithm")) or head.get("ServerSideEncryption") in (
        "aws:kms",
        "aws:kms:dsse",
    )
    if _MD5.match(etag) and not encrypted:
        return etag, DigestKind.MD5
    checksum = head.get("ChecksumSHA256", "")
    if checksum and head.get("ChecksumType") == "FULL_OBJECT":
        try:
            return base64.b64decode(checksum, validate=True).hex(), DigestKind.SHA256
        except (binascii.Error, ValueError):
            pass
    given = head.get("Metadata", {}).get(SHA256_METADATA, "").lower()
    if _SHA256.match(given):
        return given, DigestKind.SHA256
    why = (
        f"it was uploaded in {etag.rpartition('-')[2]} parts"
        if "-" in etag
        else "it is encrypted with KMS or a customer key"
    )
    raise ConfigError(
        f"object {key!r}: its ETag is not the MD5 of its bytes ({why}) and it has no"
        f" whole-object SHA-256 (a FULL_OBJECT ChecksumSHA256, or the metadata"
        f" {SHA256_METADATA}=<hex>, as `aws s3 cp --metadata {SHA256_METADATA}=...` sets)"
    )


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def _why(exc: Exception, source: S3Source, store: S3Store) -> str:
    """What went wrong, for the user: the reason, never a credential or a traceback."""
    from botocore.exceptions import BotoCoreError  # noqa: PLC0415  (boto3 loads late)

    code = _code(exc)
    if code == "NoSuchBucket":
        return f"bucket {source.bucket!r} not found on {store.where}"
    if code in _DENIED:
        return (
            f"access denied to {source.uri()} on {store.where} ({code}): storage profile"
            f" {store.profile!r}'s credentials cannot list or read it"
        )
    if code:
        return f"{source.uri()} on {store.where}: the store answered {code}"
    if isinstance(exc, BotoCoreError | OSError):
        return f"the store at {store.where} could not be reached ({type(exc).__name__})"
    return f"{source.uri()} on {store.where}: {type(exc).__name__}"
