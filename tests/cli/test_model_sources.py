"""``hf://`` sources pinned at ``llmgw model apply``: against a Hub-compatible
server on loopback (tests/hub_server.py) through the real ``huggingface_hub``
client and the real CLI, seeded with the generated tiny GGUF and tiny
Hugging Face checkpoint. No network; hf_xet off (HF_HUB_DISABLE_XET=1: the
server speaks no Xet)."""

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw.catalog import CatalogModel, parse_catalog
from llmgw.catalog_sources import check_sources, pin_sources
from llmgw.errors import ConfigError
from llmgw.hub_pin import Hub
from llmgw.sources import HfSource, LocalSource, S3Source, parse_source
from llmgw.store import Store
from llmgw.store.catalog_store import get_entry
from llmgw.types.weights_manifest import DigestKind, ManifestFile, WeightsManifest, git_blob_sha1
from llmgw_cli.dev.tinyhf import TinyHfModel
from llmgw_cli.dev.tinymodel import TinyModel
from tests.hub_server import HubServer

TOKEN = "hf_secret_token_abc123"
GGUF = "tiny-llama.gguf"


@pytest.fixture(scope="module")
def hub(tiny: TinyModel, tinyhf: TinyHfModel) -> Iterator[HubServer]:
    server = HubServer()
    server.commit("org/tiny-gguf", {GGUF: tiny.model_path, "README.md": tiny.model_path})
    checkpoint = {p.name: p for p in sorted(tinyhf.path.iterdir()) if p.is_file()}
    server.commit("org/tiny-hf", checkpoint)
    server.commit("org/gated", {GGUF: tiny.model_path})
    server.repos["org/gated"].gated = True
    server.repos["org/gated"].readers.add(TOKEN)
    server.commit("org/private", {GGUF: tiny.model_path})
    server.repos["org/private"].private = True
    server.repos["org/private"].readers.add(TOKEN)
    with server.running():
        yield server


def _cli(db: Path, hub: HubServer, *args: str, token: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "LLMGW_HF_TOKEN"}
    env |= {
        "LLMGW_STORE_URL": f"sqlite:///{db}",
        "LLMGW_HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(db.parent / "hf-home"),  # no token of the developer's
        "COLUMNS": "250",
    }
    if token:
        env["LLMGW_HF_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _catalog(path: Path, *entries: str) -> Path:
    path.write_text("models:\n" + "".join(f"  - {e}\n" for e in entries))
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_parse_hf_s3_modelscope_and_local() -> None:
    assert parse_source("hf://Qwen/Qwen2.5-7B-Instruct") == HfSource("Qwen/Qwen2.5-7B-Instruct")
    assert parse_source("hf://org/repo@v1.0/sub/m-Q4_K_M.gguf") == HfSource(
        "org/repo", "v1.0", "sub/m-Q4_K_M.gguf"
    )
    assert parse_source("hf://org/repo@refs%2Fpr%2F1") == HfSource("org/repo", "refs/pr/1")
    assert parse_source("s3://bucket/models/x/") == S3Source("bucket", "models/x")
    assert parse_source("file:///srv/a/../m.gguf") == LocalSource("/srv/m.gguf")
    for bad, why in [
        ("hf://org", "not a valid repo name"),
        ("hf://org/repo/../x.gguf", "must not hold '..'"),
        ("hf://org/re po", "not a valid repo name"),
        ("hf://org/repo@", "not a revision"),
        ("hf://org/repo?x=1", "no query"),
        ("modelscope://org/repo/file.bin", "name the repo only"),
        ("s3://B", "not an S3 bucket name"),
        ("gs://bucket/x", "not a source llmgw knows"),
        ("models/tiny.gguf", "absolute path"),
    ]:
        with pytest.raises(ConfigError, match=why):
            parse_source(bad)


def test_manifest_paths_digests_and_artifact_id() -> None:
    config = ManifestFile(
        path="config.json", size=2, digest=git_blob_sha1(b"{}"), digest_kind=DigestKind.GIT_SHA1
    )
    weights = ManifestFile(path="a/model.safetensors", size=10, digest="0" * 64)
    one = WeightsManifest(files=(config, weights))
    assert [f.path for f in one.files] == ["a/model.safetensors", "config.json"]  # sorted
    assert one.total_bytes() == 12
    assert one.artifact_id() == WeightsManifest(files=(weights, config)).artifact_id()
    assert one.artifact_id().startswith("sha256:")
    assert one.artifact_id() != WeightsManifest(files=(config,)).artifact_id()
    for path in ["/etc/passwd", "../x", "a/../../x", "a//b", "a\\b", ""]:
        with pytest.raises(ValueError, match="file path"):
            ManifestFile(path=path, size=1, digest="0" * 64)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        ManifestFile(path="x", size=1, digest="0" * 40)
    with pytest.raises(ValueError, match="listed twice"):
        WeightsManifest(files=(config, config))


def test_apply_pins_main_to_the_commit_and_lists_the_seeded_files(
    hub: HubServer, tiny: TinyModel, tinyhf: TinyHfModel, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    file = _catalog(
        tmp_path / "c.yaml",
        f"{{name: g, source: 'hf://org/tiny-gguf/{GGUF}'}}",
        "{name: v, engine: vllm, source: 'hf://org/tiny-hf@main'}",
    )
    applied = _cli(db, hub, "model", "apply", str(file))
    assert applied.returncode == 0, applied.stderr
    gguf_commit = hub.repos["org/tiny-gguf"].refs["main"]
    assert f"pinned org/tiny-gguf@{gguf_commit[:12]} (main: 1 files" in applied.stderr
    store = Store(f"sqlite:///{db}")
    try:
        g, v = get_entry(store, "g"), get_entry(store, "v")
    finally:
        store.close()
    assert g is not None and g.pin is not None and v is not None and v.pin is not None
    assert (g.pin.revision, g.pin.requested) == (gguf_commit, "main")
    (only,) = g.pin.manifest.files
    assert (only.path, only.size, only.digest, only.digest_kind) == (
        GGUF, tiny.model_path.stat().st_size, _sha256(tiny.model_path), DigestKind.SHA256,
    )  # fmt: skip
    assert v.pin.revision == hub.repos["org/tiny-hf"].refs["main"]
    seeded = {p.name: p for p in tinyhf.path.iterdir() if p.is_file()}
    assert {f.path for f in v.pin.manifest.files} == set(seeded)  # all the engine needs
    for f in v.pin.manifest.files:
        data = seeded[f.path].read_bytes()
        assert f.size == len(data)
        lfs = f.path.endswith(".safetensors") or len(data) >= 10 * 1024
        assert f.digest_kind is (DigestKind.SHA256 if lfs else DigestKind.GIT_SHA1)
        assert f.digest == (hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data))
    assert v.pin.total_bytes() == sum(p.stat().st_size for p in seeded.values())

    shown = _cli(db, hub, "model", "show", "v")
    assert shown.returncode == 0, shown.stderr
    assert f"revision: {v.pin.revision}" in shown.stdout


def test_a_moved_branch_keeps_the_pin_until_refresh(
    hub: HubServer, tiny: TinyModel, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    hub.commit("org/moving", {GGUF: tiny.model_path})
    first = hub.repos["org/moving"].refs["main"]
    file = _catalog(tmp_path / "c.yaml", f"{{name: m, source: 'hf://org/moving/{GGUF}'}}")
    assert _cli(db, hub, "model", "apply", str(file)).returncode == 0
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny.model_path.read_bytes() + b"\0")
    moved = hub.commit("org/moving", {GGUF: other})
    assert moved != first

    kept = _cli(db, hub, "model", "apply", str(file))
    assert kept.returncode == 0, kept.stderr
    assert f"@{first[:12]}" in kept.stderr
    refreshed = _cli(db, hub, "model", "apply", "--refresh", str(file))
    assert refreshed.returncode == 0, refreshed.stderr
    store = Store(f"sqlite:///{db}")
    try:
        entry = get_entry(store, "m")
    finally:
        store.close()
    assert entry is not None and entry.pin is not None and entry.pin.revision == moved
    assert entry.pin.manifest.files[0].digest == _sha256(other)


def test_each_bad_source_is_refused_at_apply_naming_its_field_and_nothing_is_written(
    hub: HubServer, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    hf_entries = [
        f"{{name: ok, source: 'hf://org/tiny-gguf/{GGUF}'}}",
        f"{{name: missing, source: 'hf://org/nope/{GGUF}'}}",
        f"{{name: gated, source: 'hf://org/gated/{GGUF}'}}",
        f"{{name: rev, source: 'hf://org/tiny-gguf@v9/{GGUF}'}}",
        "{name: nofile, source: 'hf://org/tiny-gguf'}",
        "{name: vllm-gguf, engine: vllm, source: 'hf://org/tiny-gguf'}",
    ]
    # modelscope://: tests/cli/test_modelscope_sources.py; s3://: tests/cli/test_s3_sources.py.
    refused = _cli(db, hub, "model", "apply", str(_catalog(tmp_path / "hf.yaml", *hf_entries)))
    assert refused.returncode == 1, refused.stderr
    said = " ".join(refused.stderr.split())
    assert f"models[1].source: repo org/nope on {hub.url} not found" in said
    assert f"models[2].source: org/gated on {hub.url} is gated: reading it needs a token" in said
    assert f"models[3].source: revision 'v9' not found in org/tiny-gguf on {hub.url}" in said
    assert "models[4].source: llama.cpp serves one GGUF file: name it" in said
    assert f"has {GGUF}" in said
    assert "models[5].source: vllm needs config.json: none in org/tiny-gguf" in said
    assert "models[0]" not in said
    store = Store(f"sqlite:///{db}")
    try:
        store.migrate()
        assert store.model_names() == []  # the good entry was not written either
    finally:
        store.close()


def test_a_named_file_that_is_not_there_and_a_token_that_reads_gated_and_private(
    hub: HubServer, tmp_path: Path
) -> None:
    def pinned(source: str, token: str = "") -> tuple[list[CatalogModel], list[str]]:
        entries = parse_catalog(f"models:\n  - {{name: m, source: '{source}'}}\n")
        return pin_sources(entries, {}, Hub(hub.url, token))

    _, problems = pinned("hf://org/tiny-gguf/other.gguf")
    assert problems[0].startswith("models[0].source: file 'other.gguf' not found in org/tiny-gguf")
    _, problems = pinned(f"hf://org/private/{GGUF}")
    assert "not found (a private repo needs a token: LLMGW_HF_TOKEN)" in problems[0]
    _, problems = pinned(f"hf://org/gated/{GGUF}", token="hf_wrong")
    assert "is gated and the token has no access" in problems[0]
    assert "hf_wrong" not in problems[0]
    for repo in ("gated", "private"):
        (entry,), problems = pinned(f"hf://org/{repo}/{GGUF}", token=TOKEN)
        assert problems == []
        assert TOKEN not in entry.model_dump_json()


def test_the_token_is_never_stored_shown_or_said(hub: HubServer, tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    file = _catalog(tmp_path / "c.yaml", f"{{name: g, source: 'hf://org/gated/{GGUF}'}}")
    applied = _cli(db, hub, "model", "apply", str(file), token=TOKEN)
    assert applied.returncode == 0, applied.stderr
    bad = _catalog(tmp_path / "bad.yaml", f"{{name: p, source: 'hf://org/nope/{GGUF}'}}")
    refused = _cli(db, hub, "model", "apply", str(bad), token=TOKEN)
    assert refused.returncode == 1
    assert "not found, or the token cannot read it" in " ".join(refused.stderr.split())
    shown = [_cli(db, hub, "model", "show", "g", *a, token=TOKEN) for a in ((), ("--json",))]
    listed = _cli(db, hub, "model", "list", "--json", token=TOKEN)
    for done in (applied, refused, *shown, listed):
        assert TOKEN not in done.stdout + done.stderr
    assert TOKEN.encode() not in db.read_bytes()


def test_remote_entries_skip_the_node_check_and_adapters_stay_local() -> None:
    entries = parse_catalog(
        "models:\n  - name: m\n    source: hf://org/repo/m.gguf\n"
        "    adapters: [{name: a, source: 'hf://org/lora'}]\n"
    )
    found = check_sources(entries, {})
    assert found.notes == []
    assert found.problems == [
        "models[0].adapters[0].source: adapters are read from local paths only"
    ]


def test_the_test_hub_serves_what_huggingface_hub_downloads(
    hub: HubServer, tinyhf: TinyHfModel, tmp_path: Path
) -> None:
    """The server a fetcher is tested against: the library's own listing and
    download agree with the seeded bytes, and a Range is answered with 206."""
    from huggingface_hub import HfApi, hf_hub_download  # noqa: PLC0415

    commit = hub.repos["org/tiny-hf"].refs["main"]
    tree = HfApi(endpoint=hub.url).list_repo_tree("org/tiny-hf", revision="main", token=False)
    listed = {getattr(e, "path", "") for e in tree}
    assert listed == {p.name for p in tinyhf.path.iterdir() if p.is_file()}
    got = hf_hub_download(
        "org/tiny-hf", "model.safetensors", revision=commit, endpoint=hub.url,
        cache_dir=tmp_path / "cache", token=False,
    )  # fmt: skip
    assert Path(got).read_bytes() == (tinyhf.path / "model.safetensors").read_bytes()
    assert f"/snapshots/{commit}/" in got
    url = f"{hub.url}/org/tiny-hf/resolve/{commit}/model.safetensors"
    part = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206
    assert part.content == (tinyhf.path / "model.safetensors").read_bytes()[10:20]
    assert part.headers["X-Repo-Commit"] == commit
    assert part.headers["Content-Range"].startswith("bytes 10-19/")


def test_a_pin_given_in_the_file_is_kept_when_it_pins_the_source(hub: HubServer) -> None:
    source = f"hf://org/tiny-gguf/{GGUF}"
    entries = parse_catalog(f"models:\n  - {{name: m, source: '{source}'}}\n")
    (entry,), problems = pin_sources(entries, {}, Hub(hub.url))
    assert problems == [] and entry.pin is not None
    shown = entry.model_dump(mode="json", exclude_defaults=True)
    # model show's YAML, applied again: the pin as given, the Hub not asked.
    again = parse_catalog(yaml.safe_dump({"models": [shown]}))
    (kept,), problems = pin_sources(again, {}, Hub("http://127.0.0.1:1"))
    assert problems == [] and kept.pin == entry.pin
    other = [again[0].model_copy(update={"source": f"hf://org/tiny-gguf@v2/{GGUF}"})]
    _, problems = pin_sources(other, {}, Hub(hub.url))
    assert problems == [
        "models[0].pin: it pins 'main', the source asks 'v2' (leave the pin out to resolve it)"
    ]
    moved = [again[0].model_copy(update={"source": f"hf://org/tiny-hf/{GGUF}"})]
    _, problems = pin_sources(moved, {}, Hub(hub.url))
    assert problems == ["models[0].pin: it pins org/tiny-gguf, not org/tiny-hf"]
