"""A node's peer server (worker_agent/fetch/peer_server.py) for tests, on loopback.

``running(root, key)`` serves in a thread until its block ends; ``python -m
tests.peer_node ROOT KEY`` serves in a child process (for the SIGKILL test)
and prints its port on stdout once it listens.
"""

import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from worker_agent.fetch.peer_server import PeerServer


def _listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections wait in the backlog until uvicorn accepts
    return sock


def _server(
    root: Path, key: str, part_wait_s: float, start_wait_s: float, max_transfers: int = 16
) -> uvicorn.Server:
    app = PeerServer(
        root, key, part_wait_s=part_wait_s, start_wait_s=start_wait_s, max_transfers=max_transfers
    ).app
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))


@contextmanager
def running(
    root: Path,
    key: str,
    *,
    part_wait_s: float = 10.0,
    start_wait_s: float = 0.5,
    max_transfers: int = 16,
) -> Iterator[str]:
    """The peer server over the cache ``root``; yields its base URL (a key it
    does not hold is a 404 after ``start_wait_s``, short for tests)."""
    sock = _listening()
    server = _server(root, key, part_wait_s, start_wait_s, max_transfers)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def main(root: str, key: str) -> None:
    sock = _listening()
    print(sock.getsockname()[1], flush=True)
    _server(Path(root), key, 10.0, 0.5).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
