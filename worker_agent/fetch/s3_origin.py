"""The files of a pinned ``s3://`` source as the fetch library's FileSpecs:
one presigned GET URL per object, at its pinned version.

A presigned URL carries its signature in the query, so the fetcher needs no
S3 client and no credential: it GETs the URL with Range like any other file,
and verifies the bytes against the pin (the ETag's MD5, or the sha256 the pin
took). The URL is a credential while it lasts: it is short-lived
(``expires_s``, which should outlast the fetch, retries included: a resume
after the expiry is refused with 403), and ``http_file.shown`` cuts the query
from every message the fetcher writes.
"""

from typing import TYPE_CHECKING

from llmgw.errors import ConfigError
from llmgw.sources import S3_SCHEME, S3Source
from llmgw.storage_profiles import StorageProfile, s3_client
from llmgw.types.weights_manifest import SourcePin
from worker_agent.fetch.spec import FileSpec

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

DEFAULT_EXPIRES_S = 3600


def s3_file_specs(
    source: S3Source,
    pin: SourcePin,
    profile: StorageProfile,
    *,
    expires_s: int = DEFAULT_EXPIRES_S,
    client: "S3Client | None" = None,
) -> tuple[FileSpec, ...]:
    """A FileSpec per file of ``pin`` (an s3 pin of ``source``), its URL a GET
    presigned with ``profile``'s keys for ``expires_s`` seconds (an unsigned
    URL for a profile without keys). Raises ConfigError when the pin is not
    this source's, OSError when the profile's secret file cannot be read.
    Signing is local: no request reaches the store here."""
    if pin.scheme != S3_SCHEME or pin.repo != source.repo:
        raise ConfigError(f"{source.uri()}: the pin is {pin.scheme}://{pin.repo}'s")
    if client is None:
        client = s3_client(profile, profile.secret())
    specs = []
    for f in pin.manifest.files:
        params = {"Bucket": source.bucket, "Key": source.key(f.path)}
        if f.version_id:
            params["VersionId"] = f.version_id
        url = client.generate_presigned_url(
            "get_object", Params=params, ExpiresIn=expires_s, HttpMethod="GET"
        )
        specs.append(FileSpec(url, f.path, f.size, f.digest, f.digest_kind))
    return tuple(specs)
