"""``s3://`` sources pinned at ``llmgw model apply`` and fetched from presigned
URLs: against moto's S3 server on loopback (tests/s3_server.py) through boto3,
the real CLI and the real fetch library, seeded with the generated tiny GGUF
and tiny Hugging Face checkpoint. No network."""

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw import s3_pin
from llmgw.catalog import CatalogModel, parse_catalog
from llmgw.catalog_sources import pin_sources
from llmgw.errors import ConfigError
from llmgw.hub_pin import Hub
from llmgw.lifecycle import setup_logging
from llmgw.sources import S3Source, parse_source
from llmgw.storage_profiles import StorageProfile, parse_profiles
from llmgw.store import Store
from llmgw.store.catalog_store import get_entry
from llmgw.types.weights_manifest import DigestKind, SourcePin
from llmgw_cli.dev.tinyhf import TinyHfModel
from llmgw_cli.dev.tinymodel import TinyModel
from tests.s3_server import S3Server
from worker_agent.fetch import ArtifactCache, ArtifactSpec, FetchPolicy, FileMismatch
from worker_agent.fetch.s3_origin import s3_file_specs
from worker_agent.origins import Origins, artifact_for
from worker_agent.weights import UnsupportedSource

BUCKET = "llmgw-models"
VERSIONED = "llmgw-versioned"
GGUF = "tiny-llama.gguf"
SECRET = "s3-secret-never-shown-42"
NO_HUB = Hub("http://127.0.0.1:1")
FAST = FetchPolicy(attempts=2, backoff_s=0.01, max_backoff_s=0.01, stall_s=10)


@pytest.fixture(scope="module")
def s3(tiny: TinyModel, tinyhf: TinyHfModel) -> Iterator[S3Server]:
    server = S3Server()
    with server.running():
        server.bucket(BUCKET)
        server.put(BUCKET, f"tiny/{GGUF}", tiny.model_path)
        server.put(BUCKET, "tiny/README.md", b"# tiny\n")
        for p in sorted(tinyhf.path.iterdir()):
            if p.is_file():
                server.put(BUCKET, f"hf/{p.name}", p)
        server.put(BUCKET, "hf/extra/notes.txt", b"not for the engine")
        server.put(BUCKET, "noconfig/model.safetensors", tinyhf.path / "model.safetensors")
        big = [b"a" * 5 * 2**20, b"tail"]
        server.put_multipart(BUCKET, "multipart/model.safetensors", big)
        server.put(BUCKET, "multipart/config.json", b"{}")
        whole = hashlib.sha256(b"".join(big)).hexdigest()
        server.put_multipart(BUCKET, "tagged/model.safetensors", big, {"sha256": whole})
        server.put(BUCKET, "tagged/config.json", b"{}")
        server.bucket(VERSIONED, versioned=True)
        yield server


def _profiles(s3: S3Server, **more: StorageProfile) -> dict[str, StorageProfile]:
    return {"default": s3.profile("AKIAANY0000000000000", SECRET), **more}


def _pin(
    s3: S3Server,
    source: str,
    *fields: str,
    profiles: dict[str, StorageProfile] | None = None,
    stored: CatalogModel | None = None,
    refresh: bool = False,
) -> tuple[list[CatalogModel], list[str]]:
    extra = "".join(f", {f}" for f in fields)
    entries = parse_catalog(f"models:\n  - {{name: m, source: '{source}'{extra}}}\n")
    return pin_sources(
        entries,
        {} if stored is None else {"m": stored},
        NO_HUB,
        refresh=refresh,
        profiles=_profiles(s3) if profiles is None else profiles,
    )


def _cli(db: Path, profiles: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LLMGW_"))}
    env |= {"LLMGW_STORAGE_PROFILES": profiles, "LLMGW_STORE_URL": f"sqlite:///{db}"}
    env |= {"COLUMNS": "250", "AWS_CONFIG_FILE": os.devnull}
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _profiles_env(s3: S3Server, key: str = "AKIAANY0000000000000", secret: str = SECRET) -> str:
    one = {"endpoint_url": s3.url, "access_key_id": key, "secret_access_key": secret}
    return json.dumps({"default": {**one, "addressing_style": "path"}})


def _catalog(path: Path, *entries: str) -> Path:
    path.write_text("models:\n" + "".join(f"  - {e}\n" for e in entries))
    return path


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def test_profiles_parse_without_showing_a_secret_and_sources_name_their_keys() -> None:
    (name, profile), = parse_profiles(
        json.dumps({"minio": {"access_key_id": "AK", "secret_access_key": SECRET}})
    ).items()  # fmt: skip
    assert name == "minio" and profile.secret() == SECRET and SECRET not in repr(profile)
    for bad in (
        {"p": {"secret_access_key": SECRET}},
        {"p": {"access_key_id": "AK", "secret_access_key": SECRET, "addressing_style": SECRET}},
        {"p": SECRET},
    ):
        with pytest.raises(ConfigError, match=r"LLMGW_STORAGE_PROFILES\.p") as refused:
            parse_profiles(json.dumps(bad))
        assert SECRET not in str(refused.value)
    with pytest.raises(ConfigError, match="not JSON"):
        parse_profiles('{"p": ' + SECRET)
    source = parse_source(f"s3://{BUCKET}/tiny/{GGUF}")
    assert isinstance(source, S3Source) and source.names_object
    assert source.key(GGUF) == f"tiny/{GGUF}" and source.repo == f"{BUCKET}/tiny/{GGUF}"
    checkpoint = S3Source(BUCKET, "")
    assert checkpoint.key("config.json") == "config.json" and checkpoint.repo == BUCKET


def test_apply_pins_an_object_and_a_checkpoint_with_sizes_and_etags(
    s3: S3Server, tiny: TinyModel, tinyhf: TinyHfModel, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    file = _catalog(
        tmp_path / "c.yaml",
        f"{{name: g, source: 's3://{BUCKET}/tiny/{GGUF}'}}",
        f"{{name: v, engine: vllm, source: 's3://{BUCKET}/hf', storage_profile: default}}",
    )
    applied = _cli(db, _profiles_env(s3), "model", "apply", str(file))
    assert applied.returncode == 0, applied.stderr
    assert f"pinned {BUCKET}/tiny/{GGUF}@" in applied.stderr
    store = Store(f"sqlite:///{db}")
    try:
        g, v = get_entry(store, "g"), get_entry(store, "v")
    finally:
        store.close()
    assert g is not None and g.pin is not None and v is not None and v.pin is not None
    assert (g.pin.scheme, g.pin.repo, g.pin.requested) == ("s3", f"{BUCKET}/tiny/{GGUF}", "latest")
    assert len(g.pin.revision) == 64
    (only,) = g.pin.manifest.files
    data = tiny.model_path.read_bytes()
    assert (only.path, only.size, only.digest, only.digest_kind, only.version_id) == (
        GGUF, len(data), _md5(data), DigestKind.MD5, None,
    )  # fmt: skip
    seeded = {p.name: p.read_bytes() for p in tinyhf.path.iterdir() if p.is_file()}
    # The engine's files only: extra/notes.txt is not one.
    assert {f.path: (f.size, f.digest) for f in v.pin.manifest.files} == {
        name: (len(b), _md5(b)) for name, b in seeded.items()
    }
    shown = _cli(db, _profiles_env(s3), "model", "show", "v")
    assert shown.returncode == 0, shown.stderr
    assert f"revision: {v.pin.revision}" in shown.stdout
    for done in (applied, shown):
        assert SECRET not in done.stdout + done.stderr
    assert SECRET.encode() not in db.read_bytes()


def test_each_bad_s3_source_is_refused_at_apply_naming_its_field(
    s3: S3Server, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    file = _catalog(
        tmp_path / "c.yaml",
        f"{{name: ok, source: 's3://{BUCKET}/tiny/{GGUF}'}}",
        f"{{name: nobucket, source: 's3://no-such-bucket/tiny/{GGUF}'}}",
        f"{{name: empty, engine: vllm, source: 's3://{BUCKET}/nothing-here'}}",
        f"{{name: noconfig, engine: vllm, source: 's3://{BUCKET}/noconfig'}}",
        f"{{name: nofile, source: 's3://{BUCKET}/tiny'}}",
        f"{{name: missing, source: 's3://{BUCKET}/tiny/other.gguf'}}",
        f"{{name: profile, source: 's3://{BUCKET}/tiny/{GGUF}', storage_profile: minio}}",
        f"{{name: parts, engine: vllm, source: 's3://{BUCKET}/multipart'}}",
        "{name: local, source: /srv/m.gguf, storage_profile: default}",
    )
    refused = _cli(db, _profiles_env(s3), "model", "apply", str(file))
    assert refused.returncode == 1, refused.stderr
    said = " ".join(refused.stderr.split())
    assert f"models[1].source: bucket 'no-such-bucket' not found on {s3.url}" in said
    assert f"models[2].source: no objects under s3://{BUCKET}/nothing-here/" in said
    assert f"models[3].source: vllm needs config.json: none in s3://{BUCKET}/noconfig" in said
    assert "models[4].source: llama.cpp serves one GGUF file: name its object" in said
    assert f"there are {GGUF}" in said
    assert f"models[5].source: object 'tiny/other.gguf' not found in bucket '{BUCKET}'" in said
    assert (
        "models[6].storage_profile: no storage profile 'minio' (LLMGW_STORAGE_PROFILES has:"
        " default)" in said
    )
    assert "models[7].source: object 'multipart/model.safetensors': its ETag is not" in said
    assert "uploaded in 2 parts" in said
    assert "models[8].storage_profile: only for s3:// sources" in said
    assert "models[0]" not in said and SECRET not in said
    store = Store(f"sqlite:///{db}")
    try:
        store.migrate()
        assert store.model_names() == []  # the good entry was not written either
    finally:
        store.close()
    # No profile at all: the entry's storage_profile is named, not a crash.
    _, problems = _pin(s3, f"s3://{BUCKET}/tiny/{GGUF}", profiles={})
    assert problems == [
        "models[0].storage_profile: left out, and there is no 'default' storage profile"
        " (LLMGW_STORAGE_PROFILES has: none)"
    ]


def test_a_listing_of_many_pages_is_read_whole_and_a_huge_one_refused(
    s3: S3Server, tinyhf: TinyHfModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {p.name for p in tinyhf.path.iterdir() if p.is_file()}
    assert len(files) > 2
    monkeypatch.setattr(s3_pin, "PAGE_SIZE", 2)  # a page per two objects
    (entry,), problems = _pin(s3, f"s3://{BUCKET}/hf", "engine: vllm")
    assert problems == [] and entry.pin is not None
    assert {f.path for f in entry.pin.manifest.files} == files
    monkeypatch.setattr(s3_pin, "MAX_OBJECTS", 2)
    _, problems = _pin(s3, f"s3://{BUCKET}/hf", "engine: vllm")
    assert problems == [
        f"models[0].source: more than 2 objects under s3://{BUCKET}/hf/: name the prefix"
        " of one checkpoint"
    ]


def test_bad_credentials_are_access_denied_and_the_secret_is_never_said(
    s3: S3Server, tmp_path: Path
) -> None:
    key, secret = s3.reader("pinner")
    secret_file = tmp_path / "s3-secret"
    secret_file.write_text(secret + "\n")
    by_file = s3.profile(key, secret_access_key_file=str(secret_file))
    source = f"s3://{BUCKET}/tiny/{GGUF}"
    db = tmp_path / "s.db"
    file = _catalog(tmp_path / "c.yaml", f"{{name: g, source: '{source}'}}")
    with s3.checking_credentials():
        (entry,), problems = _pin(s3, source, profiles={"default": by_file})
        assert problems == [] and entry.pin is not None
        _, problems = _pin(s3, source, profiles={"default": s3.profile(key, SECRET)})
        (problem,) = problems
        assert problem.startswith(
            f"models[0].source: access denied to {source} on {s3.url} (SignatureDoesNotMatch):"
            " storage profile 'default'"
        )
        refused = _cli(db, _profiles_env(s3, "AKIANOSUCHKEY0000000", SECRET), "model", "apply",
                       str(file))  # fmt: skip
    assert refused.returncode == 1
    said = " ".join(refused.stderr.split())
    assert "models[0].source: access denied" in said and "(InvalidAccessKeyId)" in said
    assert SECRET not in refused.stdout + refused.stderr and secret not in problem
    missing = s3.profile(key, secret_access_key_file=str(tmp_path / "absent"))
    _, problems = _pin(s3, source, profiles={"default": missing})
    assert problems == [
        "models[0].storage_profile: storage profile 'default': its secret_access_key_file"
        " cannot be read (No such file or directory)"
    ]


def test_a_versioned_bucket_pins_each_version_until_refresh(
    s3: S3Server, tiny: TinyModel, tmp_path: Path
) -> None:
    first = tiny.model_path.read_bytes()
    v1 = s3.put(VERSIONED, f"m/{GGUF}", first)
    source = f"s3://{VERSIONED}/m/{GGUF}"
    (entry,), problems = _pin(s3, source)
    assert problems == [] and entry.pin is not None
    assert entry.pin.manifest.files[0].version_id == v1
    second = first + b"\0"
    v2 = s3.put(VERSIONED, f"m/{GGUF}", second)
    assert v2 != v1
    (kept,), _ = _pin(s3, source, stored=entry)
    assert kept.pin == entry.pin  # kept: a replica started later gets the same bytes
    (fresh,), _ = _pin(s3, source, stored=entry, refresh=True)
    assert fresh.pin is not None and fresh.pin.revision != entry.pin.revision
    (now,) = fresh.pin.manifest.files
    assert (now.version_id, now.size, now.digest) == (v2, len(second), _md5(second))
    # The old pin still fetches the old bytes: its URL names its version.
    got = _fetch(s3, source, entry.pin, tmp_path / "cache")
    assert got.name == GGUF and got.read_bytes() == first  # the engine's one file
    with pytest.raises(UnsupportedSource, match="no storage profile 'minio'"):
        artifact_for(source, entry.pin, Origins(storage_profiles=_profiles(s3)), "minio")


def _fetch(s3: S3Server, source: str, pin: SourcePin | None, root: Path) -> Path:
    """The pin fetched as a node does: artifact_for's presigned FileSpecs, the cache."""
    assert pin is not None
    origins = Origins(storage_profiles=_profiles(s3), s3_url_expires_s=60)
    pinned = artifact_for(source, pin, origins)
    got = ArtifactCache(root, policy=FAST).fetch(pinned.spec)
    return got.path / pinned.file if pinned.file else got.path


def test_presigned_specs_fetch_once_verify_md5_and_sha256_and_refuse_wrong_bytes(
    s3: S3Server, tinyhf: TinyHfModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    setup_logging("DEBUG", "test")  # as an agent logs, at its most verbose
    caplog.set_level(logging.DEBUG)
    source = f"s3://{BUCKET}/hf"
    (entry,), problems = _pin(s3, source, "engine: vllm")
    assert problems == [] and entry.pin is not None
    specs = s3_file_specs(
        S3Source(BUCKET, "hf"), entry.pin, s3.profile("AKIAANY0000000000000", SECRET)
    )
    assert all("X-Amz-Signature=" in s.url and s.digest_kind is DigestKind.MD5 for s in specs)
    signatures = [s.url.rpartition("X-Amz-Signature=")[2] for s in specs]
    before = s3.served_bytes
    cache = ArtifactCache(tmp_path / "cache", policy=FAST)
    got = cache.fetch(ArtifactSpec(specs))
    for f in entry.pin.manifest.files:
        assert (got.path / f.path).read_bytes() == (tinyhf.path / f.path).read_bytes()
    assert s3.served_bytes - before == entry.pin.total_bytes()
    assert cache.fetch(ArtifactSpec(specs)).cached
    assert s3.served_bytes - before == entry.pin.total_bytes()  # once

    # A multipart object, pinned by the sha256 its metadata gives.
    (tagged,), problems = _pin(s3, f"s3://{BUCKET}/tagged", "engine: vllm")
    assert problems == [] and tagged.pin is not None
    kinds = {f.path: f.digest_kind for f in tagged.pin.manifest.files}
    assert kinds == {"config.json": DigestKind.MD5, "model.safetensors": DigestKind.SHA256}
    fetched = _fetch(s3, f"s3://{BUCKET}/tagged", tagged.pin, tmp_path / "tagged")
    assert (fetched / "model.safetensors").stat().st_size == 5 * 2**20 + 4

    # The object overwritten (same size, other bytes) after the pin: refused.
    key = f"swapped/{GGUF}"
    s3.put(BUCKET, key, b"x" * 64)
    (swapped,), _ = _pin(s3, f"s3://{BUCKET}/{key}")
    s3.put(BUCKET, key, b"y" * 64)
    with pytest.raises(FileMismatch, match=f"{GGUF}: expected md5 {_md5(b'x' * 64)}") as bad:
        _fetch(s3, f"s3://{BUCKET}/{key}", swapped.pin, tmp_path / "swapped")
    assert "X-Amz" not in str(bad.value) and SECRET not in str(bad.value)
    said = caplog.text
    assert f"GET {s3.url}/{BUCKET}/{key}?(query hidden)" in said  # httpx's line, cut
    assert "X-Amz-Signature" not in said and SECRET not in said
    assert not [s for s in signatures if s in said]  # nor botocore's signing at DEBUG
