"""Storage profiles: where an ``s3://`` source's store is and what reads it.

A cluster setting, ``LLMGW_STORAGE_PROFILES``, JSON mapping a name to a
profile; a catalog entry names one in ``storage_profile`` (left out:
``"default"``)::

    LLMGW_STORAGE_PROFILES='{"default": {"endpoint_url": "https://minio.internal:9000",
        "region": "us-east-1", "access_key_id": "AKIA...",
        "secret_access_key_file": "/run/secrets/s3", "addressing_style": "path"}}'

The URI never carries the endpoint or credentials, and no key, region or endpoint is
taken from the environment boto3 reads on its own (``AWS_*``, ``~/.aws``, an
instance role): what reads a bucket is only what the profile says, and a profile
without keys sends unsigned requests (a public bucket). The secret is a
``SecretStr`` (never in a repr) and never reaches a message: a validation
error of a profile hides its input.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, SecretStr, TypeAdapter, ValidationError, model_validator

from llmgw.errors import ConfigError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

PROFILES_SETTING = "LLMGW_STORAGE_PROFILES"
DEFAULT_PROFILE = "default"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0


class StorageProfile(BaseModel):
    """One S3-compatible store and the credentials that read it."""

    # hide_input_in_errors: a bad profile's error must not echo its secret.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    endpoint_url: str = ""  # "": AWS S3 itself
    region: str = "us-east-1"
    access_key_id: str = ""
    secret_access_key: SecretStr = SecretStr("")
    # A file holding the secret (a mounted secret), read when the store is asked.
    secret_access_key_file: Path | None = None
    # path: http://endpoint/bucket/key (most self-hosted stores); virtual:
    # http://bucket.endpoint/key; auto: boto3's choice.
    addressing_style: Literal["auto", "path", "virtual"] = "auto"

    @model_validator(mode="after")
    def _one_secret(self) -> "StorageProfile":
        given = bool(self.secret_access_key.get_secret_value())
        if given and self.secret_access_key_file is not None:
            raise ValueError("give secret_access_key or secret_access_key_file, not both")
        if (given or self.secret_access_key_file is not None) and not self.access_key_id:
            raise ValueError("a secret access key needs its access_key_id")
        return self

    def where(self) -> str:
        """The store, for messages: its endpoint (never a credential)."""
        return self.endpoint_url or f"AWS S3 ({self.region})"

    def secret(self) -> str:
        """The secret access key ("": none); OSError when its file cannot be read."""
        if self.secret_access_key_file is not None:
            return self.secret_access_key_file.read_text().strip()
        return self.secret_access_key.get_secret_value()


def parse_profiles(text: str) -> dict[str, StorageProfile]:
    """The profiles of ``LLMGW_STORAGE_PROFILES``' JSON ("": none), or a
    ConfigError naming what is wrong and where, never a value it was given."""
    if not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{PROFILES_SETTING}: not JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{PROFILES_SETTING}: a JSON object of name -> profile")
    try:
        return _PROFILES.validate_python(raw)
    except ValidationError as exc:
        where = "; ".join(
            ".".join(str(p) for p in (PROFILES_SETTING, *e["loc"])) + f": {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
        raise ConfigError(where) from None


# No AWS_ENDPOINT_URL[_S3] or endpoint_url of ~/.aws (botocore's stubs lack the option).
_NO_ENDPOINT_FROM_ENV: dict[str, Any] = {"ignore_configured_endpoint_urls": True}
_PROFILES = TypeAdapter(dict[str, StorageProfile], config=ConfigDict(hide_input_in_errors=True))


def profile_problem(profiles: dict[str, StorageProfile], name: str | None) -> str:
    """Why ``name`` (None: the default) names no usable profile ("": it does)."""
    wanted = name or DEFAULT_PROFILE
    if wanted in profiles:
        return ""
    have = ", ".join(sorted(profiles)) or "none"
    if name is None:
        return (
            f"left out, and there is no {DEFAULT_PROFILE!r} storage profile"
            f" ({PROFILES_SETTING} has: {have})"
        )
    return f"no storage profile {name!r} ({PROFILES_SETTING} has: {have})"


def s3_client(profile: StorageProfile, secret: str) -> "S3Client":
    """A boto3 S3 client for ``profile``, with ``secret`` (``profile.secret()``,
    read once by the caller); no credential, region or endpoint from the environment."""
    import boto3  # noqa: PLC0415  (slow to import; only s3:// sources need it)
    from botocore import UNSIGNED  # noqa: PLC0415
    from botocore.config import Config  # noqa: PLC0415

    config = Config(
        signature_version=UNSIGNED if not profile.access_key_id else "s3v4",
        s3={"addressing_style": profile.addressing_style},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        retries={"max_attempts": 3, "mode": "standard"},
        # Send and check a checksum only where an operation needs one: many
        # S3-compatible stores refuse the newer default checksum headers.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        **_NO_ENDPOINT_FROM_ENV,
    )
    # Keys, region and endpoint are given here, so none comes from AWS_* or ~/.aws.
    session = boto3.session.Session()
    return session.client(
        "s3",
        endpoint_url=profile.endpoint_url or None,
        region_name=profile.region,
        aws_access_key_id=profile.access_key_id or None,
        aws_secret_access_key=secret or None,
        config=config,
    )
