"""The HTTP fetch against a loopback server that misbehaves on purpose (tests/fetch_server.py)."""

import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fetch_server import Fault, FileServer
from worker_agent.fetch import (
    ArtifactCache,
    ArtifactSpec,
    FetchDeadline,
    FetchPolicy,
    FetchProgress,
    FileMismatch,
    FileSpec,
    SourceRefused,
    SourceUnavailable,
)
from worker_agent.weights import MARKER

MIB = 2**20
TOKEN = "hf_secret_token_never_shown"
POLICY = FetchPolicy(
    attempts=3, backoff_s=0.01, stall_s=10, disk_margin_bytes=0, chunk_bytes=64 * 1024
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def files() -> dict[str, bytes]:
    return {"model.safetensors": os.urandom(4 * MIB + 17), "config.json": b'{"a": 1}'}


@pytest.fixture
def server(files: dict[str, bytes]) -> Iterator[FileServer]:
    with FileServer(files) as srv:
        yield srv


def artifact(server: FileServer, files: dict[str, bytes]) -> ArtifactSpec:
    return ArtifactSpec(
        tuple(
            FileSpec(
                server.url(rel),
                rel,
                len(data),
                sha(data),
                headers=lambda: {"Authorization": f"Bearer {TOKEN}"},
            )
            for rel, data in files.items()
        )
    )


def fetch(tmp_path: Path, server: FileServer, files: dict[str, bytes], **kw: object) -> Path:
    got = ArtifactCache(tmp_path / "cache", policy=POLICY).fetch(artifact(server, files), **kw)  # type: ignore[arg-type]
    for rel, data in files.items():
        assert (got.path / rel).read_bytes() == data
    assert (got.path.parent / MARKER).is_file()
    return got.path


BIG = "model.safetensors"


def test_clean_fetch_serves_each_byte_once_and_reports_progress(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    seen: list[FetchProgress] = []
    fetch(tmp_path, server, files, progress=seen.append)
    assert server.served[BIG] == len(files[BIG])
    assert all(r.authorization == f"Bearer {TOKEN}" for r in server.requests)
    total = sum(len(d) for d in files.values())
    assert seen[-1].files_done == 2 and seen[-1].bytes_done == total == seen[-1].bytes_total
    assert seen[-1].source == "origin" and seen[-1].rate_bps > 0
    # Throttled: far fewer reports than the 64 chunks of the big file.
    assert len(seen) < 10


def test_a_cut_connection_resumes_with_range(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    server.faults[BIG] = [Fault("cut", after=3 * MIB)]
    fetch(tmp_path, server, files)
    ranges = [r.range for r in server.requests if r.path == BIG]
    assert ranges[0] is None and ranges[1] is not None
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert resumed_at > 2 * MIB
    # Bytes served twice: at most what was in flight when the connection dropped.
    assert server.served[BIG] - len(files[BIG]) == 3 * MIB - resumed_at < MIB


def test_a_200_to_a_range_request_starts_again_from_zero(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    server.faults[BIG] = [Fault("cut", after=2 * MIB), Fault("ignore_range")]
    fetch(tmp_path, server, files)
    assert [r.range is not None for r in server.requests if r.path == BIG] == [False, True]


def test_a_changed_etag_starts_again_from_zero(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    server.faults[BIG] = [Fault("cut", after=2 * MIB)]
    cache = ArtifactCache(tmp_path / "cache", policy=FetchPolicy(attempts=1, disk_margin_bytes=0))
    with pytest.raises(SourceUnavailable):
        cache.fetch(artifact(server, files))
    server.etags[BIG] = "changed"
    got = ArtifactCache(tmp_path / "cache", policy=POLICY).fetch(artifact(server, files))
    assert (got.path / BIG).read_bytes() == files[BIG]
    # The resume asked a Range, saw another ETag and fetched the whole file again.
    assert [r.range is not None for r in server.requests if r.path == BIG] == [False, True, False]


def test_a_429_waits_its_retry_after_then_succeeds(
    tmp_path: Path, server: FileServer, files: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    server.faults[BIG] = [Fault("status", 429, headers={"Retry-After": "1"})]
    with caplog.at_level(logging.INFO, logger="worker_agent.fetch"):
        fetch(tmp_path, server, files)
    assert [r.path for r in server.requests].count(BIG) == 2
    assert "trying again in 1.0s" in caplog.text
    assert TOKEN not in caplog.text


def test_a_500_then_success(tmp_path: Path, server: FileServer, files: dict[str, bytes]) -> None:
    server.faults[BIG] = [Fault("status", 500)]
    fetch(tmp_path, server, files)
    assert [r.path for r in server.requests].count(BIG) == 2
    assert server.served[BIG] == len(files[BIG])


def test_a_stall_is_detected_and_the_fetch_resumes(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    server.faults[BIG] = [Fault("stall", after=MIB)]
    policy = dataclasses.replace(POLICY, stall_s=1.0)
    got = ArtifactCache(tmp_path / "cache", policy=policy).fetch(artifact(server, files))
    assert (got.path / BIG).read_bytes() == files[BIG]
    ranges = [r.range for r in server.requests if r.path == BIG]
    # The stalled request (the server sends nothing after 1 MiB) was dropped and resumed.
    assert ranges[0] is None and len(ranges) >= 2
    assert all(r is not None and r.startswith("bytes=") for r in ranges[1:])
    assert server.served[BIG] - len(files[BIG]) < MIB


def test_the_deadline_ends_a_stalled_fetch_keeping_its_bytes(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    server.faults[BIG] = [Fault("stall", after=MIB)]
    policy = dataclasses.replace(POLICY, deadline_s=1.0)  # the stall window is 10 s
    cache = ArtifactCache(tmp_path / "cache", policy=policy)
    with pytest.raises(FetchDeadline):
        cache.fetch(artifact(server, files))
    parts = list((tmp_path / "cache").rglob("*.part"))
    assert [p.stat().st_size for p in parts] == [MIB]
    assert cache.lookup(artifact(server, files).key) is None


def test_wrong_bytes_are_deleted_and_fetched_again(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    server.faults[BIG] = [Fault("wrong")]
    fetch(tmp_path, server, files)
    assert [r.range for r in server.requests if r.path == BIG] == [None, None]


def test_bytes_wrong_every_time_fail_naming_the_file_and_both_digests(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    server.faults[BIG] = [Fault("wrong")] * POLICY.attempts
    bad = bytes(b ^ 0xFF for b in files[BIG][:16]) + files[BIG][16:]
    cache = ArtifactCache(tmp_path / "cache", policy=POLICY)
    with pytest.raises(FileMismatch) as caught:
        cache.fetch(artifact(server, files))
    message = str(caught.value)
    assert BIG in message and sha(files[BIG]) in message and sha(bad) in message
    assert [r.path for r in server.requests].count(BIG) == POLICY.attempts
    staged = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert [p.name for p in staged if "part" in p.name] == []  # the wrong bytes are gone
    assert cache.lookup(artifact(server, files).key) is None


@pytest.mark.parametrize("status", [401, 403, 404, 410])
def test_refusals_are_not_retried_and_never_show_the_token(
    tmp_path: Path,
    server: FileServer,
    files: dict[str, bytes],
    status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.faults[BIG] = [Fault("status", status)]
    cache = ArtifactCache(tmp_path / "cache", policy=POLICY)
    with caplog.at_level(logging.DEBUG), pytest.raises(SourceRefused) as caught:
        cache.fetch(artifact(server, files), user="replica-1")
    assert caught.value.status == status and not caught.value.retryable
    assert cache.users(artifact(server, files).key) == []  # a failed fetch uses nothing
    assert f"HTTP {status}" in str(caught.value)
    assert [r.path for r in server.requests].count(BIG) == 1
    assert TOKEN not in str(caught.value) and TOKEN not in repr(caught.value)
    assert TOKEN not in caplog.text


def test_a_file_of_another_size_than_the_pin_fails_naming_both_sizes(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    data = files[BIG]
    pinned = ArtifactSpec((FileSpec(server.url(BIG), BIG, len(data) + 5, sha(data)),))
    with pytest.raises(FileMismatch) as caught:
        ArtifactCache(tmp_path / "cache", policy=POLICY).fetch(pinned)
    assert f"a file of {len(data)} bytes, not {len(data) + 5}" in str(caught.value)
    assert len(server.requests) == POLICY.attempts  # a mismatch is fetched again
    assert list((tmp_path / "cache").rglob("*.part")) == []


def test_git_blob_and_md5_digests_verify_and_name_their_kind(
    tmp_path: Path, server: FileServer, files: dict[str, bytes]
) -> None:
    """A Hub file kept in git is pinned by its git blob id, an S3 object by its
    ETag's MD5: both are checked as bytes arrive, and a mismatch says which kind."""
    from llmgw.types.weights_manifest import DigestKind, git_blob_sha1  # noqa: PLC0415

    small, big = files["config.json"], files[BIG]
    good = ArtifactSpec(
        (
            FileSpec(
                server.url("config.json"),
                "config.json",
                len(small),
                git_blob_sha1(small),
                DigestKind.GIT_SHA1,
            ),
            FileSpec(server.url(BIG), BIG, len(big), hashlib.md5(big).hexdigest(), DigestKind.MD5),
        )
    )
    got = ArtifactCache(tmp_path / "cache", policy=POLICY).fetch(good)
    assert (got.path / "config.json").read_bytes() == small
    assert (got.path / BIG).read_bytes() == big
    wrong = git_blob_sha1(small + b" ")
    bad = ArtifactSpec(
        (
            FileSpec(
                server.url("config.json"), "config.json", len(small), wrong, DigestKind.GIT_SHA1
            ),
        )
    )
    with pytest.raises(FileMismatch, match=f"config.json: expected git-sha1 {wrong}"):
        ArtifactCache(tmp_path / "other", policy=POLICY).fetch(bad)
    assert not list((tmp_path / "other").glob(f"{bad.key}/*"))
