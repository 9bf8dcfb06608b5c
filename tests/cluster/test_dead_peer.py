"""The router's engine client and a host that vanishes (issue 36 scenario 4):
with the host cut off mid-request, no reset ever comes; the request is given
up after about LLMGW_UPSTREAM_DEAD_PEER_S as UpstreamHostGone (the proxy
fails it over), not after the read timeout. A live engine that is only slow
to answer is never cut."""

import asyncio
import os
import sys
import time

import pytest

from llmgw.errors import UpstreamHostGone
from llmgw_cli.procs import wait_for
from router.forwarding.upstream_raw import RawUpstream
from tests.cluster.netbed import Bed
from tests.cluster.services import reachable

PORT = 7100
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
DEAD_PEER_S = 2.0

# An engine that answers each POST after DELAY seconds (argv[2]).
SLOW = """
import socket, sys, threading, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
def serve(conn):
    with conn:
        while conn.recv(65536):
            time.sleep(float(sys.argv[2]))
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""


def _engine(bed: Bed, delay_s: float) -> str:
    bed.start("a", [sys.executable, "-c", SLOW, str(PORT), str(delay_s)], env=ENV)
    assert wait_for(lambda: reachable(bed.address("a"), PORT), 10)
    return f"http://{bed.address('a')}:{PORT}/v1/completions"


async def test_a_host_cut_off_mid_request_is_given_up_as_gone(bed: Bed) -> None:
    url = _engine(bed, delay_s=60)
    upstream = RawUpstream(5.0, 600.0, 16, dead_peer_s=DEAD_PEER_S)
    sending = asyncio.create_task(upstream.post(url, b"{}", {}))
    await asyncio.sleep(0.5)  # the request is with the engine, which is generating
    assert not sending.done()
    bed.cut("a")
    began = time.monotonic()
    with pytest.raises(UpstreamHostGone):
        await asyncio.wait_for(sending, 30)
    waited = time.monotonic() - began
    assert waited < 4 * DEAD_PEER_S, f"given up after {waited:.1f}s"


async def test_a_request_on_a_kept_connection_to_a_gone_host_is_given_up(bed: Bed) -> None:
    url = _engine(bed, delay_s=0)
    upstream = RawUpstream(5.0, 600.0, 16, dead_peer_s=DEAD_PEER_S)
    answer = await upstream.post(url, b"{}", {})
    assert answer.status == 200
    await answer.read()
    bed.cut("a")  # the connection stays pooled; the next request is written to it
    began = time.monotonic()
    with pytest.raises(UpstreamHostGone):
        await asyncio.wait_for(upstream.post(url, b"{}", {}), 30)
    assert time.monotonic() - began < 4 * DEAD_PEER_S


async def test_a_slow_live_engine_is_waited_for(bed: Bed) -> None:
    url = _engine(bed, delay_s=3 * DEAD_PEER_S)
    upstream = RawUpstream(5.0, 600.0, 16, dead_peer_s=DEAD_PEER_S)
    answer = await upstream.post(url, b"{}", {})
    assert answer.status == 200
