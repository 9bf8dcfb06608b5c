"""The artifact cache around the HTTP fetch: disk check, SIGKILL resume, single
flight across processes, the LRU budget. Children are real processes
(``python -m tests.fetch_server child``) fetching from the loopback server."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fetch_server import Fault, FileServer
from worker_agent.fetch import ArtifactCache, ArtifactSpec, DiskTooSmall, FetchPolicy, FileSpec
from worker_agent.fetch.cache import PARTS, STAGING_PREFIX

MIB = 2**20
REPO = Path(__file__).resolve().parents[2]
BIG = "model.gguf"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def spec_of(server: FileServer, *names: str) -> ArtifactSpec:
    return ArtifactSpec(
        tuple(FileSpec(server.url(n), n, len(server.files[n]), sha(server.files[n])) for n in names)
    )


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def children() -> Iterator[Callable[[Path, ArtifactSpec], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(root: Path, artifact: ArtifactSpec) -> subprocess.Popen[str]:
        arg = {
            "root": str(root),
            "files": [[f.url, f.rel_path, f.size, f.digest] for f in artifact.files],
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fetch_server", "child", json.dumps(arg)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def part_of(root: Path, artifact: ArtifactSpec) -> Path:
    parts = root / f"{STAGING_PREFIX}{artifact.key}" / PARTS
    found = list(parts.glob("*.part"))
    return found[0] if found else parts / "none.part"


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_sigkill_at_60_percent_resumes_with_little_fetched_again(
    tmp_path: Path, children: Callable[[Path, ArtifactSpec], subprocess.Popen[str]]
) -> None:
    data = os.urandom(16 * MIB)
    root = tmp_path / "cache"
    with FileServer({BIG: data}) as server:
        at = int(len(data) * 0.6)
        server.faults[BIG] = [Fault("pause", after=at)]
        artifact = spec_of(server, BIG)
        child = children(root, artifact)
        assert server.paused.wait(60)
        # What the server sent is on disk (written unbuffered as it arrived): kill now.
        wait_for(lambda: size(part_of(root, artifact)) >= at, "the partial at 60%")
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        # Killed mid-file: nothing looks complete, nothing is under its final name.
        assert ArtifactCache(root).lookup(artifact.key) is None
        assert list(root.rglob(BIG)) == []
        got = ArtifactCache(root, policy=FetchPolicy(disk_margin_bytes=0)).fetch(artifact)
        assert (got.path / BIG).read_bytes() == data
        assert [r.range for r in server.requests] == [None, f"bytes={at}-"]
        fetched_again = server.served[BIG] - len(data)
        assert fetched_again <= 0.05 * len(data)


def _blocked_on(lock: Path) -> bool:
    """Whether some process waits for the flock on ``lock`` (/proc/locks' "->" lines)."""
    inode = f":{lock.stat().st_ino} "
    return any(
        "->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines()
    )


def test_two_processes_fetching_one_artifact_download_it_once(
    tmp_path: Path, children: Callable[[Path, ArtifactSpec], subprocess.Popen[str]]
) -> None:
    data = os.urandom(4 * MIB)
    root = tmp_path / "cache"
    with FileServer({BIG: data}) as server:
        server.faults[BIG] = [Fault("pause", after=2 * MIB)]
        artifact = spec_of(server, BIG)
        first = children(root, artifact)
        assert server.paused.wait(60)
        second = children(root, artifact)
        wait_for(lambda: _blocked_on(root / f"{artifact.key}.lock"), "the second fetch to wait")
        server.release()
        outs = [json.loads(p.communicate(timeout=60)[0]) for p in (first, second)]
        assert first.returncode == second.returncode == 0
        assert [o["cached"] for o in outs] == [False, True]
        assert outs[0]["path"] == outs[1]["path"]
        assert (Path(outs[0]["path"]) / BIG).read_bytes() == data
        assert server.served[BIG] == len(data)
        assert len(server.requests) == 1


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here (root needed): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_too_little_disk_is_refused_before_fetching_naming_needed_and_free(
    small_disk: Path,
) -> None:
    with FileServer({BIG: os.urandom(3 * MIB)}) as server:
        cache = ArtifactCache(small_disk / "cache", policy=FetchPolicy(disk_margin_bytes=MIB))
        with pytest.raises(DiskTooSmall) as caught:
            cache.fetch(spec_of(server, BIG))
        assert caught.value.needed == 4 * MIB
        assert 0 < caught.value.free <= 2 * MIB
        assert f"{4 * MIB} bytes needed" in str(caught.value)
        assert f"{caught.value.free} free" in str(caught.value)
        assert server.requests == []


def test_the_lru_budget_evicts_the_least_recently_used_artifact_not_in_use(tmp_path: Path) -> None:
    files = {name: os.urandom(100_000) for name in ("a", "b", "c", "d")}
    root = tmp_path / "cache"
    with FileServer(files) as server:
        cache = ArtifactCache(root, policy=FetchPolicy(disk_margin_bytes=0), budget_bytes=250_000)
        a, b, c, d = (spec_of(server, n) for n in "abcd")
        cache.fetch(a, user="replica-1")
        cache.fetch(b)
        os.utime(root / a.key, ns=(1, 1))  # a is the least recently used, but in use
        os.utime(root / b.key, ns=(2, 2))
        cache.fetch(c)
        assert cache.lookup(a.key) is not None
        assert cache.lookup(b.key) is None and not (root / b.key).exists()
        assert cache.lookup(c.key) is not None
        cache.release(a.key, "replica-1")
        os.utime(root / a.key, ns=(1, 1))
        cache.fetch(d)
        assert cache.lookup(a.key) is None
        assert cache.lookup(c.key) is not None and cache.lookup(d.key) is not None
        assert sorted(
            p.name for p in root.iterdir() if not p.name.endswith((".lock", ".users"))
        ) == sorted([c.key, d.key])
