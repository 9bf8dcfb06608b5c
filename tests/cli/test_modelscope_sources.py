"""``modelscope://`` sources: pinned at ``llmgw model apply`` (the real CLI)
against a ModelScope-compatible server on loopback (tests/modelscope_server.py),
and fetched by a node's ArtifactCache from the FileSpecs ``artifact_for``
builds of the pin. Seeded with the generated tiny GGUF and tiny checkpoint."""

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.catalog import CatalogModel, parse_catalog
from llmgw.catalog_sources import pin_sources
from llmgw.hub_pin import Hub
from llmgw.modelscope_pin import ModelScope
from llmgw.sources import ModelScopeSource, parse_source
from llmgw.store import Store
from llmgw.store.catalog_store import get_entry
from llmgw.types.weights_manifest import SourcePin
from llmgw_cli.dev.tinyhf import TinyHfModel
from llmgw_cli.dev.tinymodel import TinyModel
from tests.modelscope_server import ModelScopeServer
from worker_agent.fetch import ArtifactCache, FetchPolicy
from worker_agent.fetch.errors import FileMismatch
from worker_agent.origins import Origins, artifact_for

TOKEN = "ms_secret_token_abc123"
GGUF = "tiny-llama.gguf"
NO_HUB = Hub("http://127.0.0.1:1")


@pytest.fixture(scope="module")
def ms(tiny: TinyModel, tinyhf: TinyHfModel) -> Iterator[ModelScopeServer]:
    server = ModelScopeServer()
    checkpoint = {p.name: p for p in sorted(tinyhf.path.iterdir()) if p.is_file()}
    server.publish("org/tiny-hf", checkpoint)
    server.publish("org/tiny-gguf", {GGUF: tiny.model_path, "README.md": tiny.model_path})
    server.publish("org/tiny-gguf", {f"q/{GGUF}": tiny.model_path}, revision="v1", tag=True)
    server.publish("org/two-ggufs", {"a.gguf": tiny.model_path, "b.gguf": tiny.model_path})
    server.publish("org/private", {GGUF: tiny.model_path})
    server.repos["org/private"].private = True
    server.repos["org/private"].readers.add(TOKEN)
    with server.running():
        yield server


def _cli(
    db: Path, ms: ModelScopeServer, *args: str, token: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_MODELSCOPE")}
    env |= {"LLMGW_STORE_URL": f"sqlite:///{db}", "LLMGW_MODELSCOPE_ENDPOINT": ms.url}
    env |= {"LLMGW_HF_ENDPOINT": "http://127.0.0.1:1", "COLUMNS": "250"}
    if token:
        env["LLMGW_MODELSCOPE_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _catalog(path: Path, *entries: str) -> Path:
    path.write_text("models:\n" + "".join(f"  - {e}\n" for e in entries))
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pinned(ms: ModelScopeServer, entry: str, token: str = "") -> tuple[CatalogModel, list[str]]:
    entries = parse_catalog(f"models:\n  - {entry}\n")
    (got,), problems = pin_sources(entries, {}, NO_HUB, modelscope=ModelScope(ms.url, token))
    return got, problems


def test_parse_a_modelscope_source() -> None:
    assert parse_source("modelscope://Qwen/Qwen2.5-7B") == ModelScopeSource("Qwen/Qwen2.5-7B")
    assert parse_source("modelscope://org/r@v1.0") == ModelScopeSource("org/r", "v1.0")
    branch = parse_source("modelscope://org/r@release%2F1")
    assert branch == ModelScopeSource("org/r", "release/1")
    assert branch.uri() == "modelscope://org/r@release%2F1"


def test_model_apply_pins_a_checkpoint_and_a_gguf_at_a_tag(
    ms: ModelScopeServer, tinyhf: TinyHfModel, tiny: TinyModel, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    file = _catalog(
        tmp_path / "c.yaml",
        "{name: hf, engine: vllm, source: 'modelscope://org/tiny-hf'}",
        "{name: gguf, source: 'modelscope://org/tiny-gguf@v1'}",
    )
    applied = _cli(db, ms, "model", "apply", str(file))
    assert applied.returncode == 0, applied.stderr
    store = Store(f"sqlite:///{db}")
    try:
        hf, gguf = get_entry(store, "hf"), get_entry(store, "gguf")
    finally:
        store.close()
    assert hf is not None and hf.pin is not None and gguf is not None and gguf.pin is not None
    assert (hf.pin.scheme, hf.pin.repo, hf.pin.requested) == ("modelscope", "org/tiny-hf", "master")
    on_disk = {p.name: _sha256(p) for p in tinyhf.path.iterdir() if p.is_file()}
    assert all(f.digest == on_disk[f.path] for f in hf.pin.manifest.files)
    assert "config.json" in {f.path for f in hf.pin.manifest.files}
    assert gguf.pin.requested == "v1" and len(gguf.pin.revision) == 64
    assert [(f.path, f.digest) for f in gguf.pin.manifest.files] == [
        (f"q/{GGUF}", _sha256(tiny.model_path))
    ]
    # Applied again: the stored pins are kept, ModelScope not asked for a listing.
    asked = len(ms.requests)
    again = _cli(db, ms, "model", "apply", str(file))
    assert again.returncode == 0, again.stderr
    assert len(ms.requests) == asked


def test_each_bad_source_is_refused_naming_its_field_and_nothing_is_written(
    ms: ModelScopeServer, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    file = _catalog(
        tmp_path / "bad.yaml",
        "{name: ok, source: 'modelscope://org/tiny-gguf'}",
        "{name: missing, engine: vllm, source: 'modelscope://org/nope'}",
        "{name: rev, engine: vllm, source: 'modelscope://org/tiny-hf@v9'}",
        "{name: vllm-gguf, engine: vllm, source: 'modelscope://org/tiny-gguf'}",
        "{name: two, source: 'modelscope://org/two-ggufs'}",
        "{name: nogguf, source: 'modelscope://org/tiny-hf'}",
        "{name: private, source: 'modelscope://org/private'}",
    )
    refused = _cli(db, ms, "model", "apply", str(file))
    assert refused.returncode == 1, refused.stderr
    said = " ".join(refused.stderr.split())
    assert f"models[1].source: repo org/nope on {ms.url} not found" in said
    assert f"models[2].source: revision 'v9' not found in org/tiny-hf on {ms.url}" in said
    assert "models[3].source: vllm needs config.json: none in org/tiny-gguf@master" in said
    assert "models[4].source: llama.cpp serves one GGUF file: 2 of org/two-ggufs@master's" in said
    assert "name one with include: [FILE.gguf]" in said
    assert "models[5].source: llama.cpp serves one GGUF file: org/tiny-hf@master has no" in said
    assert "models[6].source: repo org/private" in said
    assert "a private repo needs a token: LLMGW_MODELSCOPE_TOKEN" in said
    assert "models[0]" not in said
    store = Store(f"sqlite:///{db}")
    try:
        store.migrate()
        assert store.model_names() == []  # the good entry was not written either
    finally:
        store.close()
    # include chooses the one GGUF of two.
    two = "{name: two, source: 'modelscope://org/two-ggufs', include: [b.gguf]}"
    entry, problems = _pinned(ms, two)
    assert problems == [] and entry.pin is not None
    assert [f.path for f in entry.pin.manifest.files] == ["b.gguf"]


def test_a_private_repo_is_pinned_and_fetched_with_the_token_never_kept(
    ms: ModelScopeServer, tiny: TinyModel, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    file = _catalog(tmp_path / "c.yaml", "{name: p, source: 'modelscope://org/private'}")
    applied = _cli(db, ms, "model", "apply", str(file), token=TOKEN)
    assert applied.returncode == 0, applied.stderr
    shown = _cli(db, ms, "model", "show", "p", "--json", token=TOKEN)
    assert shown.returncode == 0, shown.stderr
    for done in (applied, shown):
        assert TOKEN not in done.stdout + done.stderr
    assert TOKEN.encode() not in db.read_bytes()
    store = Store(f"sqlite:///{db}")
    try:
        entry = get_entry(store, "p")
    finally:
        store.close()
    assert entry is not None and entry.pin is not None
    origins = Origins(modelscope_endpoint=ms.url, modelscope_token=lambda: TOKEN)
    artifact = artifact_for(entry.source, entry.pin, origins)
    assert artifact.file == GGUF
    got = ArtifactCache(tmp_path / "cache", policy=FetchPolicy(disk_margin_bytes=0)).fetch(
        artifact.spec
    )
    assert (got.path / GGUF).read_bytes() == tiny.model_path.read_bytes()


def test_a_node_fetches_the_pinned_files_every_byte_once(
    ms: ModelScopeServer, tinyhf: TinyHfModel, tmp_path: Path
) -> None:
    entry, problems = _pinned(ms, "{name: m, engine: vllm, source: 'modelscope://org/tiny-hf'}")
    assert problems == [] and entry.pin is not None
    pin: SourcePin = entry.pin
    artifact = artifact_for(entry.source, pin, Origins(modelscope_endpoint=ms.url))
    assert artifact.file is None
    assert all(f.url.startswith(f"{ms.url}/api/v1/models/org/tiny-hf/repo?Revision=master&")
               for f in artifact.spec.files)  # fmt: skip
    before = ms.served_bytes
    cache = ArtifactCache(tmp_path / "cache", policy=FetchPolicy(disk_margin_bytes=0))
    got = cache.fetch(artifact.spec)
    for f in pin.manifest.files:
        assert (got.path / f.path).read_bytes() == (tinyhf.path / f.path).read_bytes()
    assert ms.served_bytes - before == pin.total_bytes()


def test_a_file_changed_under_the_pinned_name_fails_the_fetch_not_served(
    ms: ModelScopeServer, tiny: TinyModel, tmp_path: Path
) -> None:
    ms.publish("org/moving", {GGUF: tiny.model_path})
    entry, problems = _pinned(ms, "{name: m, source: 'modelscope://org/moving'}")
    assert problems == [] and entry.pin is not None
    other = tmp_path / "other.gguf"
    other.write_bytes(b"\1" * tiny.model_path.stat().st_size)
    ms.publish("org/moving", {GGUF: other})  # master moves; ModelScope has no commit
    artifact = artifact_for(entry.source, entry.pin, Origins(modelscope_endpoint=ms.url))
    cache = ArtifactCache(tmp_path / "cache", policy=FetchPolicy(disk_margin_bytes=0))
    with pytest.raises(FileMismatch):
        cache.fetch(artifact.spec)
    # Pinned again, it is another revision.
    moved, problems = _pinned(ms, "{name: m, source: 'modelscope://org/moving'}")
    assert problems == [] and moved.pin is not None
    assert moved.pin.revision != entry.pin.revision


def test_the_test_server_answers_what_modelscope_hub_reads(
    ms: ModelScopeServer, tinyhf: TinyHfModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModelScope's own client against the server the pinning is tested with:
    its revisions, listing and download agree with the seeded bytes, a private
    repo is read with the token as the client sends it, and a Range is a 206."""
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-home"))
    from modelscope_hub import HubApi  # noqa: PLC0415  (it reads the cache setting)
    from modelscope_hub.errors import NotExistError  # noqa: PLC0415

    api = HubApi(endpoint=ms.url)
    assert {r["Revision"] for r in api.list_repo_revisions("org/tiny-gguf", "model")} == {
        "master",
        "v1",
    }
    listed = api.list_repo_files("org/tiny-hf", "model", revision="master")
    on_disk = {p.name: p for p in tinyhf.path.iterdir() if p.is_file()}
    assert {f.path: f.sha256 for f in listed if f.type == "blob"} == {
        name: _sha256(p) for name, p in on_disk.items()
    }
    got = api.download_file(
        "org/tiny-hf", "model", "model.safetensors", revision="master",
        cache_dir=tmp_path / "cache", expected_sha256=_sha256(on_disk["model.safetensors"]),
    )  # fmt: skip
    assert Path(got).read_bytes() == on_disk["model.safetensors"].read_bytes()
    private = HubApi(endpoint=ms.url, token=TOKEN)
    assert private.list_repo_revisions("org/private", "model")
    with pytest.raises(NotExistError):
        api.list_repo_revisions("org/private", "model")
    url = f"{ms.url}/api/v1/models/org/tiny-hf/repo?Revision=master&FilePath=model.safetensors"
    part = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206
    assert part.content == on_disk["model.safetensors"].read_bytes()[10:20]
