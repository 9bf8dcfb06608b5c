"""The weights fetch step: real files under tmp_path, copied into a real cache."""

import hashlib
import itertools
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from worker_agent.weights import (
    MARKER,
    ChecksumMismatch,
    FetchedWeights,
    LocalSource,
    Roots,
    SourceMissing,
    UnsupportedSource,
    WeightsCache,
    WeightsError,
    source_for,
)

MIB = 2**20
# Sources built from URIs alone (nothing is read): confinement is
# tests/agent/test_weights_roots.py's.
ROOTS = Roots.of([Path("/models")])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entries(root: Path) -> list[str]:
    """Everything in the cache root except the lock files, which are meant to stay."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


class Recorder:
    """A progress callback that remembers what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))


@pytest.fixture
def weights_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(3 * MIB + 123)
    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """An HF-style model dir: config, two shards, tokenizer in a subdir, a symlinked file."""
    root = tmp_path / "src" / "tiny-llama"
    (root / "tokenizer").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model-00001-of-00002.safetensors").write_bytes(os.urandom(MIB + 7))
    (root / "model-00002-of-00002.safetensors").write_bytes(os.urandom(5000))
    (root / "tokenizer" / "tokenizer.json").write_text('{"vocab": {}}')
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    blob.write_text("generation config")
    (root / "generation_config.json").symlink_to(blob)
    return root


def dir_digest(root: Path) -> str:
    """The documented directory digest, computed independently of the module."""
    lines = sorted(
        f"{p.relative_to(root).as_posix()}\0{sha(p.read_bytes())}\n"
        for p in root.rglob("*")
        if p.is_file()
    )
    return sha("".join(lines).encode())


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_file_fetch_copies_then_serves_from_cache(
    tmp_path: Path, weights_file: tuple[Path, bytes], as_url: bool
) -> None:
    src, data = weights_file
    uri = src.as_uri() if as_url else str(src)
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    first_progress = Recorder()

    first = cache.fetch(uri, progress=first_progress)

    assert not first.cached
    assert first.sha256 == sha(data)
    assert first.size_bytes == len(data)
    assert first.path.name == "model.gguf"
    assert first.path.read_bytes() == data
    assert first.path.parent.parent == tmp_path / "cache"
    assert first_progress.calls[-1] == (len(data), len(data))
    assert (first.path.parent / MARKER).is_file()

    second_progress = Recorder()
    second = cache.fetch(uri, progress=second_progress)
    assert second == FetchedWeights(first.path, first.sha256, first.size_bytes, cached=True)
    assert second_progress.calls == []
    # The other spelling of the same file is the same source, so the same entry.
    other = str(src) if as_url else src.as_uri()
    assert cache.fetch(other).cached


def test_changed_source_is_fetched_again(tmp_path: Path, weights_file: tuple[Path, bytes]) -> None:
    src, data = weights_file
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    old = cache.fetch(str(src))

    new_data = bytes(reversed(data))  # same size: only the mtime gives it away
    src.write_bytes(new_data)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, old_mtime_plus_one(st.st_mtime_ns)))
    new = cache.fetch(str(src))

    assert not new.cached
    assert new.sha256 == sha(new_data) != old.sha256
    assert new.path.read_bytes() == new_data
    assert old.path.read_bytes() == data  # an engine still reading the old copy keeps it


def old_mtime_plus_one(mtime_ns: int) -> int:
    """An mtime that certainly differs, even on filesystems with coarse timestamps."""
    return mtime_ns + 2 * 10**9


def test_expected_checksum_match(tmp_path: Path, weights_file: tuple[Path, bytes]) -> None:
    src, data = weights_file
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    assert cache.fetch(str(src), expected_sha256=sha(data)).sha256 == sha(data)
    assert cache.fetch(str(src), expected_sha256=sha(data).upper()).cached


def test_checksum_mismatch_leaves_nothing_in_cache(
    tmp_path: Path, weights_file: tuple[Path, bytes]
) -> None:
    src, data = weights_file
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    wrong = "0" * 64

    with pytest.raises(ChecksumMismatch) as raised:
        cache.fetch(str(src), expected_sha256=wrong)

    message = str(raised.value)
    assert wrong in message and sha(data) in message and str(src) in message
    assert not raised.value.retryable
    assert entries(tmp_path / "cache") == []


def test_cached_entry_with_other_checksum_is_refused(
    tmp_path: Path, weights_file: tuple[Path, bytes]
) -> None:
    src, _ = weights_file
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    cache.fetch(str(src))
    with pytest.raises(ChecksumMismatch, match=r"0{64}"):
        cache.fetch(str(src), expected_sha256="0" * 64)


def test_directory_fetch_copies_tree_with_stable_digest(tmp_path: Path, model_dir: Path) -> None:
    one = WeightsCache(tmp_path / "cache-a", [tmp_path]).fetch(str(model_dir))
    two = WeightsCache(tmp_path / "cache-b", [tmp_path]).fetch(model_dir.as_uri())

    assert one.sha256 == two.sha256 == dir_digest(model_dir)
    assert one.path.name == "tiny-llama" and one.path.is_dir()
    copied = sorted(p.relative_to(one.path).as_posix() for p in one.path.rglob("*"))
    assert copied == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "tokenizer",
        "tokenizer/tokenizer.json",
    ]
    # The symlink was followed: the cache holds a real file, not a link out of it.
    assert not (one.path / "generation_config.json").is_symlink()
    assert (one.path / "generation_config.json").read_text() == "generation config"
    sizes = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    assert one.size_bytes == sizes


def test_directory_edit_in_place_is_fetched_again(tmp_path: Path, model_dir: Path) -> None:
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    old = cache.fetch(str(model_dir))
    config = model_dir / "tokenizer" / "tokenizer.json"
    config.write_text('{"vocab": {"a": 1}}')
    os.utime(config, ns=(0, old_mtime_plus_one(config.stat().st_mtime_ns)))

    new = cache.fetch(str(model_dir))
    assert not new.cached
    assert new.sha256 == dir_digest(model_dir) != old.sha256


def test_symlink_loop_in_directory_terminates(tmp_path: Path, model_dir: Path) -> None:
    (model_dir / "tokenizer" / "loop").symlink_to(model_dir)
    fetched = WeightsCache(tmp_path / "cache", [tmp_path]).fetch(str(model_dir))
    assert (fetched.path / "config.json").is_file()
    assert not (fetched.path / "tokenizer" / "loop").exists()


def test_results_are_group_readable_not_world_readable(tmp_path: Path, model_dir: Path) -> None:
    for path in [model_dir, *model_dir.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o700 if path.is_dir() else 0o600)
    # A strict umask too: new files would otherwise come out 0644 by luck.
    old_umask = os.umask(0o077)
    try:
        fetched = WeightsCache(tmp_path / "cache", [tmp_path]).fetch(str(model_dir))
    finally:
        os.umask(old_umask)
    try:
        for path in [fetched.path.parent, fetched.path, *fetched.path.parent.rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o750 if path.is_dir() else 0o640), path
        assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o750
    finally:
        for path in [model_dir, *model_dir.rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() else 0o644)


def test_progress_increases_and_ends_at_total(tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    total = 9 * MIB + 5
    src.write_bytes(os.urandom(total))
    progress = Recorder()

    cache = WeightsCache(tmp_path / "cache", [tmp_path], progress_every_bytes=2 * MIB)
    cache.fetch(str(src), None, progress)

    done = [d for d, _ in progress.calls]
    assert progress.calls[0] == (0, total)
    assert progress.calls[-1] == (total, total)
    assert all(t == total for _, t in progress.calls)
    assert done == sorted(set(done)), "strictly increasing"
    gaps = [b - a for a, b in itertools.pairwise(done)]
    assert all(gap >= 2 * MIB for gap in gaps[:-1])  # throttled, not one call per chunk
    assert len(progress.calls) == 1 + 4 + 1  # start, 2/4/6/8 MiB, end


def test_failed_copy_leaves_nothing_and_next_fetch_works(
    tmp_path: Path, weights_file: tuple[Path, bytes]
) -> None:
    src, data = weights_file
    cache = WeightsCache(tmp_path / "cache", [tmp_path], progress_every_bytes=MIB)

    def explode(done: int, total: int) -> None:
        if done > 0:
            raise RuntimeError("activity cancelled")

    with pytest.raises(RuntimeError, match="cancelled"):
        cache.fetch(str(src), progress=explode)
    assert entries(tmp_path / "cache") == []

    fetched = cache.fetch(str(src))
    assert not fetched.cached and fetched.sha256 == sha(data)


def test_entry_without_marker_is_fetched_again(
    tmp_path: Path, weights_file: tuple[Path, bytes]
) -> None:
    src, data = weights_file
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    first = cache.fetch(str(src))
    (first.path.parent / MARKER).unlink()
    first.path.write_bytes(data[:100])  # as if a crash cut the copy short

    again = cache.fetch(str(src))
    assert not again.cached
    assert again.path.read_bytes() == data


@pytest.mark.parametrize("uri", ["s3://b/k", "hf://org/m", "https://x/y", "gs://b/o"])
def test_a_remote_source_without_a_pin_is_refused(uri: str) -> None:
    """The local weights cache never fetches: a remote source reaches a node
    with its pin (worker_agent/remote_weights.py) or is refused, saying so."""
    with pytest.raises(UnsupportedSource, match="has no pin") as raised:
        source_for(uri, ROOTS)
    assert repr(uri) in str(raised.value)
    assert not raised.value.retryable


@pytest.mark.parametrize("uri", ["models/llama.gguf", "file://host/models/x", ""])
def test_relative_or_foreign_paths_are_refused(tmp_path: Path, uri: str) -> None:
    with pytest.raises(UnsupportedSource, match="absolute"):
        WeightsCache(tmp_path / "cache", [tmp_path]).fetch(uri)


def test_local_uris_map_to_local_source() -> None:
    source = source_for("file:///models/my%20model", ROOTS)
    assert isinstance(source, LocalSource) and source.path == Path("/models/my model")
    assert isinstance(source_for("/models/x.gguf", ROOTS), LocalSource)


def test_missing_source(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(SourceMissing, match=r"nope\.gguf") as raised:
        WeightsCache(tmp_path / "cache", [tmp_path]).fetch(str(missing))
    assert isinstance(raised.value, WeightsError) and not raised.value.retryable


def test_concurrent_fetches_share_one_copy(
    tmp_path: Path, weights_file: tuple[Path, bytes]
) -> None:
    src, data = weights_file
    cache = WeightsCache(tmp_path / "cache", [tmp_path])
    start = threading.Barrier(2)
    results: list[FetchedWeights] = []
    errors: list[BaseException] = []

    def slow_start(done: int, total: int) -> None:
        if done == 0:
            time.sleep(0.3)  # hold the lock long enough that the other thread must wait

    def fetch() -> None:
        start.wait()
        try:
            results.append(cache.fetch(str(src), expected_sha256=sha(data), progress=slow_start))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    assert sorted(r.cached for r in results) == [False, True]
    assert results[0].path == results[1].path
    assert results[0].path.read_bytes() == data
    assert len(entries(tmp_path / "cache")) == 1
