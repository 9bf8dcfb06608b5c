"""An S3-compatible server on loopback, for tests that reach no cloud: moto's
server mode (the WSGI app ``moto_server`` runs), in a thread of the test.

The code under test talks to it through boto3 and plain HTTP GETs of
presigned URLs, as it would to AWS S3 or MinIO. What the helper adds:

- ``served_bytes``: the object bytes sent by GETs, for tests of fetchers;
- ``reader()``: an IAM user with its access key, allowed to list and read;
- ``checking_credentials()``: moto checks signatures and policies only while
  this is on (its ``INITIAL_NO_AUTH_ACTION_COUNT``, process-wide). Off by
  default, because moto cannot serve a presigned GET with it on (it reads an
  Authorization header such a request does not have): presigned URLs are
  therefore served here without their signature checked.

moto keeps its state per process: tests use bucket names of their own.
"""

import json
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from moto import settings as moto_settings
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import BaseWSGIServer, make_server

from llmgw.storage_profiles import StorageProfile

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# moto accepts any key while it checks nothing; these create the buckets.
ADMIN_KEY = ("AKIAADMIN00000000000", "admin-secret")
REGION = "us-east-1"
_READ_POLICY = {
    "Version": "2012-10-17",
    # moto checks a HEAD of an object as s3:HeadObject (AWS: s3:GetObject).
    "Statement": [
        {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*", "s3:Head*"], "Resource": "*"}
    ],
}


class _Quiet(MotoRequestHandler):
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # werkzeug's access log would print each presigned URL


class S3Server:
    """moto's S3 on 127.0.0.1 at a free port, counting object bytes served."""

    def __init__(self) -> None:
        self.served_bytes = 0
        self._lock = threading.Lock()
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def _counting(self, app: Any) -> Callable[..., Iterable[bytes]]:
        def counted(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            # A GET of an object: /bucket/key..., no listing query.
            is_object = environ["REQUEST_METHOD"] == "GET" and environ["PATH_INFO"].count("/") >= 2
            for chunk in app(environ, start_response):
                if is_object:
                    with self._lock:
                        self.served_bytes += len(chunk)
                yield chunk

        return counted

    @contextmanager
    def running(self) -> Iterator["S3Server"]:
        app = self._counting(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_Quiet)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host!s}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._server.server_close()

    def profile(self, key_id: str = "", secret: str = "", **fields: Any) -> StorageProfile:
        """A storage profile that reaches this server (path-style, as most stores)."""
        return StorageProfile.model_validate(
            {
                "endpoint_url": self.url,
                "region": REGION,
                "access_key_id": key_id,
                "secret_access_key": secret,
                "addressing_style": "path",
                **fields,
            }
        )

    def client(self, service: str = "s3", key: tuple[str, str] = ADMIN_KEY) -> Any:
        return boto3.client(
            service,  # type: ignore[call-overload]
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=key[0],
            aws_secret_access_key=key[1],
            config=Config(s3={"addressing_style": "path"}),
        )

    def s3(self) -> "S3Client":
        client: S3Client = self.client("s3")
        return client

    def bucket(self, name: str, versioned: bool = False) -> None:
        s3 = self.s3()
        s3.create_bucket(Bucket=name)
        if versioned:
            s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})

    def put(
        self, bucket: str, key: str, data: bytes | Path, metadata: dict[str, str] | None = None
    ) -> str:
        """The object written in one part; its VersionId ("" unversioned)."""
        body = data.read_bytes() if isinstance(data, Path) else data
        done = self.s3().put_object(Bucket=bucket, Key=key, Body=body, Metadata=metadata or {})
        return done.get("VersionId", "")

    def put_multipart(
        self, bucket: str, key: str, parts: list[bytes], metadata: dict[str, str] | None = None
    ) -> None:
        """The object uploaded in ``parts`` (each but the last 5 MiB or more)."""
        s3 = self.s3()
        upload = s3.create_multipart_upload(Bucket=bucket, Key=key, Metadata=metadata or {})
        done = []
        for number, body in enumerate(parts, start=1):
            part = s3.upload_part(
                Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number, Body=body
            )
            done.append({"PartNumber": number, "ETag": part["ETag"]})
        s3.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload["UploadId"],
            MultipartUpload={"Parts": done},  # type: ignore[typeddict-item]
        )

    def reader(self, name: str) -> tuple[str, str]:
        """A new IAM user allowed to list and read every bucket: its key id and secret."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        iam.put_user_policy(
            UserName=name, PolicyName="read", PolicyDocument=json.dumps(_READ_POLICY)
        )
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return str(key["AccessKeyId"]), str(key["SecretAccessKey"])

    @contextmanager
    def checking_credentials(self) -> Iterator[None]:
        """moto checks each request's signature and the key's policies meanwhile."""
        before = moto_settings.INITIAL_NO_AUTH_ACTION_COUNT
        moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        try:
            yield
        finally:
            moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = before
