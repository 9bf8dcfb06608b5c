"""Spreading an artifact node to node: each node's cache behind its peer server
(tests/peer_node.py, uvicorn on loopback), the origin a FileServer counting the
bytes it sends (tests/fetch_server.py). Node ids are distinct cache roots."""

import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests import peer_node
from tests.fetch_server import Fault, FileServer
from worker_agent.fetch import (
    ArtifactCache,
    ArtifactSpec,
    FetchedArtifact,
    FetchPolicy,
    FetchProgress,
    FileSpec,
    Peer,
    peer_headers,
    peer_key,
)
from worker_agent.fetch.cache import PARTS, STAGING_PREFIX, part_name
from worker_agent.fetch.spread import plan_spread

MIB = 2**20
REPO = Path(__file__).resolve().parents[2]
BIG = "model.safetensors"
KEY = peer_key("engine-key-secret-of-this-cluster")
POLICY = FetchPolicy(
    attempts=3,
    backoff_s=0.01,
    stall_s=10,
    peer_stall_s=10,
    disk_margin_bytes=0,
    chunk_bytes=256 * 1024,
    progress_interval_s=0,
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def files() -> dict[str, bytes]:
    return {BIG: os.urandom(8 * MIB + 5), "config.json": b'{"a": 1}'}


@pytest.fixture
def origin(files: dict[str, bytes]) -> Iterator[FileServer]:
    with FileServer(files) as srv:
        yield srv


def artifact(origin: FileServer, *peers: Peer) -> ArtifactSpec:
    return ArtifactSpec(
        tuple(FileSpec(origin.url(p), p, len(d), sha(d)) for p, d in origin.files.items()),
        peers=peers,
    )


def peer(name: str, url: str, key: str = KEY) -> Peer:
    return Peer(name, url, peer_headers(key))


def verified(got: FetchedArtifact, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (got.path / rel).read_bytes() == data


def total(files: dict[str, bytes]) -> int:
    return sum(len(d) for d in files.values())


def test_three_nodes_in_a_chain_take_the_artifact_from_the_origin_once(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes]
) -> None:
    caches = {n: ArtifactCache(tmp_path / n, policy=POLICY) for n in ("node1", "node2", "node3")}
    seen: list[FetchProgress] = []
    with (
        peer_node.running(caches["node1"].root, KEY) as url1,
        peer_node.running(caches["node2"].root, KEY) as url2,
    ):
        first = caches["node1"].fetch(artifact(origin))
        second = caches["node2"].fetch(artifact(origin, peer("node1", url1)))
        third = caches["node3"].fetch(
            artifact(origin, peer("node1", url1), peer("node2", url2)), progress=seen.append
        )
    for got in (first, second, third):
        verified(got, files)
    assert sum(origin.served.values()) == total(files)  # once, for the first node
    assert first.bytes_by_source == {"origin": total(files)}
    assert second.bytes_by_source == third.bytes_by_source == {"node1": total(files)}
    assert {p.source for p in seen} == {"node1"}
    assert caches["node1"].fetch(artifact(origin)).bytes_by_source == {}  # a hit moves nothing


def test_nodes_fetching_at_once_form_a_tree_over_growing_files(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes]
) -> None:
    """node2 reads node1's partial as it grows, node3 node2's: the origin is held
    at half the big file until all three are on it, and serves it once."""
    caches = {n: ArtifactCache(tmp_path / n, policy=POLICY) for n in ("node1", "node2", "node3")}
    origin.faults[BIG] = [Fault("pause", after=4 * MIB)]
    got: dict[str, FetchedArtifact] = {}

    def fetch(name: str, spec: ArtifactSpec) -> threading.Thread:
        thread = threading.Thread(target=lambda: got.update({name: caches[name].fetch(spec)}))
        thread.start()
        return thread

    def part_size(name: str) -> int:
        part = caches[name].root / f"{STAGING_PREFIX}{artifact(origin).key}" / PARTS
        try:
            return (part / part_name(BIG)).stat().st_size
        except FileNotFoundError:
            return 0

    with (
        peer_node.running(caches["node1"].root, KEY) as url1,
        peer_node.running(caches["node2"].root, KEY) as url2,
    ):
        threads = [fetch("node1", artifact(origin))]
        assert origin.paused.wait(10)
        threads.append(fetch("node2", artifact(origin, peer("node1", url1))))
        wait_for(lambda: part_size("node2") >= 4 * MIB, "node2 to hold node1's first half")
        threads.append(fetch("node3", artifact(origin, peer("node2", url2), peer("node1", url1))))
        wait_for(lambda: part_size("node3") >= 4 * MIB, "node3 to hold node2's first half")
        origin.release()
        for thread in threads:
            thread.join(30)
    assert sorted(got) == ["node1", "node2", "node3"]
    for done in got.values():
        verified(done, files)
    assert origin.served[BIG] == len(files[BIG])
    assert got["node2"].bytes_by_source.get("node1", 0) >= len(files[BIG])
    assert got["node3"].bytes_by_source.get("node2", 0) >= len(files[BIG])


def test_nodes_started_together_wait_for_each_other_not_for_the_origin(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes]
) -> None:
    """All start at once with the peers plan_spread gives: a node asks its parent
    before the parent has begun, and is held until it has, not sent to the origin."""
    nodes = ["node1", "node2", "node3", "node4"]
    plan = plan_spread([], nodes, fanout=2)
    got: dict[str, FetchedArtifact] = {}
    with ExitStack() as stack:
        urls = {
            n: stack.enter_context(peer_node.running(tmp_path / n, KEY, start_wait_s=10))
            for n in nodes
        }
        threads = []
        for node in reversed(nodes):  # the children first: their parents have not begun
            spec = artifact(origin, *(peer(p, urls[p]) for p in plan[node]))
            cache = ArtifactCache(tmp_path / node, policy=POLICY)
            threads.append(
                threading.Thread(target=lambda c=cache, s=spec, n=node: got.update({n: c.fetch(s)}))
            )
            threads[-1].start()
        for thread in threads:
            thread.join(30)
    assert sorted(got) == nodes
    for done in got.values():
        verified(done, files)
    assert sum(origin.served.values()) == total(files)
    assert set(got["node4"].bytes_by_source) == {plan["node4"][0]}


def test_a_peer_killed_mid_copy_leaves_the_rest_to_the_origin(tmp_path: Path) -> None:
    files = {BIG: os.urandom(32 * MIB), "config.json": b"{}"}
    with FileServer(files) as origin:
        seeded = ArtifactCache(tmp_path / "node1", policy=POLICY).fetch(artifact(origin))
        verified(seeded, files)
        served_before = origin.served[BIG]
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.peer_node", str(tmp_path / "node1"), KEY],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            url = f"http://127.0.0.1:{child.stdout.readline().strip()}"
            killed_at: list[int] = []

            def kill_at_half(p: FetchProgress) -> None:
                if not killed_at and p.source == "node1" and p.bytes_done >= 16 * MIB:
                    killed_at.append(p.bytes_done)
                    child.send_signal(signal.SIGKILL)
                    child.wait(10)

            wait_for(lambda: _answers(url), "the child's peer server")
            got = ArtifactCache(tmp_path / "node2", policy=POLICY).fetch(
                artifact(origin, peer("node1", url)), progress=kill_at_half
            )
        finally:
            child.kill()
            child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
        verified(got, files)
        assert killed_at, "the peer was never killed"
        from_origin = origin.served[BIG] - served_before
        # The origin sent what the peer had not: not the whole file again.
        assert 0 < from_origin <= len(files[BIG]) - killed_at[0]
        ranges = [r.range for r in origin.requests if r.path == BIG]
        assert ranges[-1] is not None and ranges[-1].startswith("bytes=")
        fetched = sum(got.bytes_by_source.values())
        assert got.bytes_by_source["node1"] >= killed_at[0]
        assert fetched - total(files) <= 0.05 * total(files)  # bytes fetched twice: few


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/artifacts/x/files/y").status_code == 401
    except httpx.TransportError:
        return False


def test_a_lying_peer_costs_a_try_and_never_a_wrong_file(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes]
) -> None:
    """node1's copy rotted on disk (it serves wrong bytes under the right ETag);
    node3 verifies, discards them and takes the file from node2."""
    liar = ArtifactCache(tmp_path / "node1", policy=POLICY).fetch(artifact(origin))
    ArtifactCache(tmp_path / "node2", policy=POLICY).fetch(artifact(origin))
    rotten = bytearray(files[BIG])
    rotten[MIB] ^= 0xFF
    (liar.path / BIG).write_bytes(bytes(rotten))
    served = sum(origin.served.values())
    node3 = ArtifactCache(tmp_path / "node3", policy=POLICY)
    with (
        peer_node.running(tmp_path / "node1", KEY) as url1,
        peer_node.running(tmp_path / "node2", KEY) as url2,
    ):
        got = node3.fetch(artifact(origin, peer("node1", url1), peer("node2", url2)))
        verified(got, files)
        assert sum(origin.served.values()) == served  # the next peer had it
        assert got.bytes_by_source["node1"] >= len(files[BIG])
        # With the liar alone, the origin is next; the cache still holds only the right bytes.
        alone = ArtifactCache(tmp_path / "node4", policy=POLICY)
        verified(alone.fetch(artifact(origin, peer("node1", url1))), files)
    assert origin.served[BIG] == 3 * len(files[BIG])
    assert not list((tmp_path / "node4").rglob("*.part"))


def test_a_peer_that_refuses_or_lacks_the_artifact_falls_back_to_the_origin(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes]
) -> None:
    ArtifactCache(tmp_path / "node1", policy=POLICY).fetch(artifact(origin))
    with (
        peer_node.running(tmp_path / "node1", KEY) as url1,
        peer_node.running(tmp_path / "empty", KEY) as empty,
    ):
        got = ArtifactCache(tmp_path / "node2", policy=POLICY).fetch(
            artifact(origin, peer("node1", url1, key=peer_key("another cluster")), peer("e", empty))
        )
    verified(got, files)
    assert got.bytes_by_source == {"origin": total(files)}


def test_the_peer_protocol_needs_the_credential_and_serves_only_pinned_files(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes]
) -> None:
    spec = artifact(origin)
    ArtifactCache(tmp_path / "node1", policy=POLICY).fetch(spec)
    (tmp_path / "secret.txt").write_text("not for peers")
    auth = {"Authorization": f"Bearer {KEY}"}
    with (
        peer_node.running(tmp_path / "node1", KEY) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        path = f"/v1/artifacts/{spec.key}/files/{BIG}"
        assert http.get(path).status_code == 401
        assert http.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        wrong = peer_key("engine-key-secret-of-another-cluster")
        assert http.get(path, headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
        whole = http.get(path, headers=auth)
        assert whole.status_code == 200 and whole.content == files[BIG]
        assert whole.headers["etag"] == sha(files[BIG])
        head = http.head(path, headers=auth)
        assert head.status_code == 200 and head.headers["content-length"] == str(len(files[BIG]))
        part = http.get(path, headers={**auth, "Range": "bytes=100-199"})
        assert part.status_code == 206 and part.content == files[BIG][100:200]
        assert part.headers["content-range"] == f"bytes 100-199/{len(files[BIG])}"
        tail = http.get(path, headers={**auth, "Range": f"bytes={MIB}-"})
        assert tail.status_code == 206 and tail.content == files[BIG][MIB:]
        beyond = http.get(path, headers={**auth, "Range": f"bytes={len(files[BIG])}-"})
        assert beyond.status_code == 416
        for bad in (
            f"/v1/artifacts/{spec.key}/files/%2e%2e/%2e%2e/secret.txt",
            f"/v1/artifacts/{spec.key}/files/..%2f..%2fsecret.txt",
            f"/v1/artifacts/{spec.key}/files/COMPLETE",
            f"/v1/artifacts/{spec.key}/files/files/{BIG}",
            f"/v1/artifacts/{'0' * 24}/files/{BIG}",
            "/v1/artifacts/..%2f..%2f/files/secret.txt",
        ):
            assert http.get(bad, headers=auth).status_code == 404, bad


def test_a_broken_peer_costs_one_try_per_artifact_and_its_credential_is_never_logged(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    """A peer answering 500, or lacking the artifact (404), is asked once, not
    once per file."""
    key = artifact(origin).key
    at = {f"v1/artifacts/{key}/files/{rel}": data for rel, data in files.items()}
    with FileServer(at) as broken, FileServer({}) as lacking:
        for path in at:
            broken.faults[path] = [Fault("status", 500)] * 3
        spec = artifact(
            origin, peer("broken", broken.url("").rstrip("/")), peer("lacking", lacking.url(""))
        )
        with caplog.at_level(logging.DEBUG):
            got = ArtifactCache(tmp_path / "node2", policy=POLICY).fetch(spec)
    verified(got, files)
    assert len(broken.requests) == 1
    assert len(lacking.requests) == 1
    assert all(r.authorization == f"Bearer {KEY}" for r in broken.requests + lacking.requests)
    assert "peer broken" in caplog.text and KEY not in caplog.text


def test_transfers_are_bounded_and_a_client_gone_frees_its_slot(
    tmp_path: Path, origin: FileServer, files: dict[str, bytes]
) -> None:
    """node1's fetch is held at half the file, so a body from its growing partial
    stays open: the one transfer allowed is in flight."""
    spec = artifact(origin)
    origin.faults[BIG] = [Fault("pause", after=4 * MIB)]
    node1 = ArtifactCache(tmp_path / "node1", policy=POLICY)
    fetching = threading.Thread(target=node1.fetch, args=(spec,))
    fetching.start()
    assert origin.paused.wait(10)
    auth = {"Authorization": f"Bearer {KEY}"}
    path = f"/v1/artifacts/{spec.key}/files/{BIG}"
    try:
        with (
            peer_node.running(tmp_path / "node1", KEY, max_transfers=1) as url,
            httpx.Client(base_url=url, timeout=30) as http,
        ):
            with http.stream("GET", path, headers=auth) as body:
                # Kept in a name: a generator dropped after next() is finalized at
                # once, which closes the connection, so the first client would be
                # gone before the second asks (a 200 whenever uvicorn saw it first).
                chunks = body.iter_raw()
                next(chunks)
                busy = http.get(path, headers=auth)
                assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            # The first client left mid-body: its slot is freed.
            wait_for(lambda: http.head(path, headers=auth).status_code == 200, "the slot freed")
            origin.release()
            fetching.join(30)
            assert http.get(path, headers=auth).content == files[BIG]
    finally:
        origin.release()
        fetching.join(30)
