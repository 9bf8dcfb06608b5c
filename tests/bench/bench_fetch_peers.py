"""Spreading weights node to node (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_fetch_peers [--mib 1024] [--nodes 4] [--fanout 2]

On loopback: one generated file behind the origin (tests/fetch_server.py, which
counts the bytes it sends), ``--nodes`` caches each behind its peer server
(worker_agent/fetch/peer_server.py under uvicorn, in this process). First one
node fetches alone from the origin (the time for one); then, in fresh caches,
all nodes start at once, their peers chosen by ``spread.plan_spread`` (the
first from the origin, the others in a tree over growing partials). Printed:
the time for one, the time until all hold the file and its ratio (target
<= 1.5), and the bytes the origin served over the file's size (target <= 1.1).
"""

import argparse
import hashlib
import os
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from tests import peer_node
from tests.fetch_server import FileServer
from worker_agent.fetch import (
    ArtifactCache,
    ArtifactSpec,
    FetchedArtifact,
    FetchPolicy,
    FileSpec,
    Peer,
    peer_headers,
    peer_key,
)
from worker_agent.fetch.spread import plan_spread

MIB = 2**20
NAME = "model.safetensors"
POLICY = FetchPolicy(disk_margin_bytes=0, backoff_s=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--fanout", type=int, default=2)
    args = parser.parse_args()
    data = os.urandom(args.mib * MIB)
    digest = hashlib.sha256(data).hexdigest()
    key = peer_key("bench-secret")
    with FileServer({NAME: data}) as origin, tempfile.TemporaryDirectory() as tmp:
        files = (FileSpec(origin.url(NAME), NAME, len(data), digest),)
        started = time.monotonic()
        ArtifactCache(Path(tmp) / "alone", policy=POLICY).fetch(ArtifactSpec(files))
        one_s = time.monotonic() - started
        origin.served.clear()

        nodes = [f"node{i}" for i in range(1, args.nodes + 1)]
        plan = plan_spread([], nodes, fanout=args.fanout)
        got: dict[str, FetchedArtifact] = {}
        with ExitStack() as stack:
            urls = {
                n: stack.enter_context(peer_node.running(Path(tmp) / n, key, start_wait_s=3.0))
                for n in nodes
            }
            threads = []
            started = time.monotonic()
            for node in nodes:
                peers = tuple(Peer(p, urls[p], peer_headers(key)) for p in plan[node])
                cache = ArtifactCache(Path(tmp) / node, policy=POLICY)
                spec = ArtifactSpec(files, peers=peers)
                thread = threading.Thread(
                    target=lambda c=cache, s=spec, n=node: got.update({n: c.fetch(s)})
                )
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
            all_s = time.monotonic() - started
    served = sum(origin.served.values())
    print(f"file: {args.mib} MiB; nodes: {args.nodes}; fan-out: {args.fanout}")
    print(f"plan: {plan}")
    print(f"one node from the origin: {one_s:.2f} s ({args.mib / one_s:.0f} MiB/s)")
    print(f"all {args.nodes} nodes: {all_s:.2f} s ({all_s / one_s:.2f}x the time for one)")
    print(f"origin served: {served / len(data):.3f}x the file")
    for node in nodes:
        by = {s: f"{b / MIB:.0f} MiB" for s, b in got[node].bytes_by_source.items()}
        print(f"  {node}: {by}")


if __name__ == "__main__":
    main()
