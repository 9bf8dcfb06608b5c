"""The router's engine client and a host that vanishes (issue 36 scenario 4):
with the host cut off mid-request, no reset ever comes; the request is given
up after about LLMGW_UPSTREAM_DEAD_PEER_S as UpstreamHostGone (the proxy
fails it over), not after the read timeout. A live engine that is only slow
to answer is never cut."""

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.errors import UpstreamHostGone
from llmgw_cli.procs import wait_for
from router.forwarding.upstream_raw import RawUpstream
from tests.cluster.netbed import Bed
from tests.cluster.services import reachable

PORT = 7100
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
DEAD_PEER_S = 2.0

# An engine that answers each POST after DELAY seconds (argv[2]), saying
# "got" on its output as each request arrives.
SLOW = """
import socket, sys, threading, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
def serve(conn):
    with conn:
        while conn.recv(65536):
            print("got", flush=True)
            time.sleep(float(sys.argv[2]))
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""


def _engine(bed: Bed, delay_s: float, log: Path) -> str:
    bed.start("a", [sys.executable, "-c", SLOW, str(PORT), str(delay_s)], env=ENV, log=log)
    assert wait_for(lambda: reachable(bed.address("a"), PORT), 10)
    return f"http://{bed.address('a')}:{PORT}/v1/completions"


def _arrived(log: Path) -> int:
    """Requests the engine has received so far."""
    return log.read_text().count("got") if log.exists() else 0


@pytest.fixture
async def upstream() -> AsyncIterator[RawUpstream]:
    """The router's engine client with a short dead-peer bound."""
    client = RawUpstream(5.0, 600.0, 16, dead_peer_s=DEAD_PEER_S)
    yield client
    await client.aclose()


async def test_a_host_cut_off_mid_request_is_given_up_as_gone(
    bed: Bed, upstream: RawUpstream, tmp_path: Path
) -> None:
    log = tmp_path / "engine.log"
    url = _engine(bed, delay_s=60, log=log)
    sending = asyncio.create_task(upstream.post(url, b"{}", {}))
    # The request is with the engine, which is generating.
    assert await asyncio.to_thread(wait_for, lambda: _arrived(log) == 1, 10)
    assert not sending.done()
    bed.cut("a")
    began = time.monotonic()
    with pytest.raises(UpstreamHostGone):
        await asyncio.wait_for(sending, 30)
    waited = time.monotonic() - began
    assert waited < 4 * DEAD_PEER_S, f"given up after {waited:.1f}s"


async def test_a_request_on_a_kept_connection_to_a_gone_host_is_given_up(
    bed: Bed, upstream: RawUpstream, tmp_path: Path
) -> None:
    url = _engine(bed, delay_s=0, log=tmp_path / "engine.log")
    answer = await upstream.post(url, b"{}", {})
    assert answer.status == 200
    await answer.read()
    bed.cut("a")  # the connection stays pooled; the next request is written to it
    began = time.monotonic()
    with pytest.raises(UpstreamHostGone):
        await asyncio.wait_for(upstream.post(url, b"{}", {}), 30)
    assert time.monotonic() - began < 4 * DEAD_PEER_S


async def test_a_slow_live_engine_is_waited_for(
    bed: Bed, upstream: RawUpstream, tmp_path: Path
) -> None:
    url = _engine(bed, delay_s=3 * DEAD_PEER_S, log=tmp_path / "engine.log")
    answer = await upstream.post(url, b"{}", {})
    assert answer.status == 200
    assert await answer.read() == b"ok"
