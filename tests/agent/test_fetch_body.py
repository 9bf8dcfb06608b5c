"""The body read straight from the socket beside the writer thread (worker_agent/fetch/body.py):
the start of the body that h11 read with the headers, a pause mid-buffer, a
write that fails in the writer thread."""

import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fetch_server import FileServer
from worker_agent.fetch import ArtifactCache, ArtifactSpec, FetchPolicy, FileSpec
from worker_agent.fetch.cache import PARTS, STAGING_PREFIX

MIB = 2**20
REPO = Path(__file__).resolve().parents[2]
# Reads of 64 KiB: the bodies below pass many buffers.
POLICY = FetchPolicy(attempts=1, disk_margin_bytes=0, chunk_bytes=64 * 1024, stall_s=10)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class OneShotServer:
    """Answers one GET with ``data``: the headers and the body's first
    ``with_head`` bytes in one send (so they reach the client's first read
    together), then, after ``pause_s``, the rest."""

    def __init__(
        self, data: bytes, *, with_head: int, pause_s: float, tls: ssl.SSLContext | None = None
    ) -> None:
        self.data = data
        self.with_head = with_head
        self.pause_s = pause_s
        self._tls = tls
        self._listener = socket.create_server(("127.0.0.1", 0))
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://127.0.0.1:{self._listener.getsockname()[1]}/file.bin"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        if self._tls is not None:
            conn = self._tls.wrap_socket(conn, server_side=True)
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            head = (
                f'HTTP/1.1 200 OK\r\nContent-Length: {len(self.data)}\r\nETag: "one"\r\n\r\n'
            ).encode()
            conn.sendall(head + self.data[: self.with_head])
            time.sleep(self.pause_s)
            conn.sendall(self.data[self.with_head :])

    def close(self) -> None:
        self._thread.join(30)
        self._listener.close()


@pytest.fixture
def data() -> bytes:
    return os.urandom(3 * MIB + 1234)


def test_body_bytes_read_with_the_headers_come_first(tmp_path: Path, data: bytes) -> None:
    # 40 KiB of body in the first segment: h11 holds it after parsing the
    # headers, so the socket's next bytes must follow it, not precede it.
    server = OneShotServer(data, with_head=40 * 1024, pause_s=0.3)
    try:
        spec = ArtifactSpec((FileSpec(server.url, "file.bin", len(data), sha(data)),))
        got = ArtifactCache(tmp_path / "cache", policy=POLICY).fetch(spec)
    finally:
        server.close()
    assert (got.path / "file.bin").read_bytes() == data


def test_a_body_over_tls_is_read_from_the_tls_socket(tmp_path: Path, data: bytes) -> None:
    # The Hub's files come over HTTPS: recv_into on the TLS socket, after what
    # h11 read (decrypted) with the headers.
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(cert, key)
    server = OneShotServer(data, with_head=40 * 1024, pause_s=0.3, tls=serving)
    try:
        spec = ArtifactSpec((FileSpec(server.url, "file.bin", len(data), sha(data)),))
        with httpx.Client(verify=ssl.create_default_context(cafile=cert)) as client:
            got = ArtifactCache(tmp_path / "cache", policy=POLICY).fetch(spec, client=client)
    finally:
        server.close()
    assert (got.path / "file.bin").read_bytes() == data


def test_a_pause_hands_the_bytes_received_to_the_partial(tmp_path: Path) -> None:
    # A 4 MiB buffer part filled when the source pauses: its bytes reach the
    # partial during the pause, not when the buffer fills.
    data = os.urandom(6 * MIB)
    server = OneShotServer(data, with_head=MIB, pause_s=2.0)
    policy = FetchPolicy(attempts=1, disk_margin_bytes=0, chunk_bytes=4 * MIB, stall_s=10)
    sizes: list[int] = []
    root = tmp_path / "cache"

    def watch() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not list(root.glob("*/files/file.bin")):
            sizes.extend(p.stat().st_size for p in root.glob(f"{STAGING_PREFIX}*/{PARTS}/*.part"))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    try:
        spec = ArtifactSpec((FileSpec(server.url, "file.bin", len(data), sha(data)),))
        watcher.start()
        got = ArtifactCache(root, policy=policy).fetch(spec)
    finally:
        watcher.join()
        server.close()
    assert (got.path / "file.bin").read_bytes() == data
    # Seen at least 1 MiB on disk while the source paused (2 s against a 0.2 s hold).
    assert max(sizes) >= MIB - 64 * 1024


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    with FileServer({"big.bin": os.urandom(16 * MIB)}) as server:
        yield server


def test_a_failed_write_in_the_writer_thread_fails_the_fetch(
    tmp_path: Path, file_server: FileServer
) -> None:
    data = file_server.files["big.bin"]
    spec = ArtifactSpec((FileSpec(file_server.url("big.bin"), "big.bin", len(data), sha(data)),))
    arg = {
        "root": str(tmp_path / "cache"),
        "files": [[f.url, f.rel_path, f.size, f.digest] for f in spec.files],
    }

    # Writes past 8 MiB fail with EFBIG (Python ignores SIGXFSZ): a disk that
    # fills mid-file, as the writer thread sees it.
    limited = (
        "import resource, runpy, sys;"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({8 * MIB}, {8 * MIB}));"
        "sys.argv = ['fetch_server', *sys.argv[1:]];"
        "runpy.run_module('tests.fetch_server', run_name='__main__')"
    )
    child = subprocess.run(
        [sys.executable, "-c", limited, "child", json.dumps(arg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.returncode != 0
    assert "File too large" in child.stderr
    assert list((tmp_path / "cache").rglob("big.bin")) == []
    assert ArtifactCache(tmp_path / "cache").lookup(spec.key) is None
