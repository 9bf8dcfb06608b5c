"""Processes for the benchmarks: free ports, spawn and stop, readiness, CPU time."""

import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw import replicas

if TYPE_CHECKING:
    from temporalio.client import Client

REPO = Path(__file__).resolve().parents[2]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (and its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(port: int, path: str, ok: Callable[[bytes], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            if ok(data):
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            args, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def stop_replicas(client: "Client | None", replica_ids: list[str]) -> None:
    """A bench's teardown: stop its replicas through the control plane, each
    failure printed and the rest stopped anyway (None: it never connected)."""
    if client is None:
        return
    for rid in replica_ids:
        try:
            await replicas.stop_replica(client, rid, "bench over", 30)
        except Exception as e:  # the teardown goes on
            print(f"stop {rid}: {e}")
