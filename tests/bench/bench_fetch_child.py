"""One timed fetch for tests/bench/bench_fetch.py, in a process of its own.

    python -m tests.bench.bench_fetch_child '{"root": DIR, "files": [[url, rel, size, sha256]]}'

Prints ``{"fetch_s": ...}``: the seconds ArtifactCache.fetch took, without
Python's start and the imports (which the bench times around the process).
It imports only the fetch, as tests/fetch_server.py's child does.
"""

import json
import sys
import time
from pathlib import Path

from worker_agent.fetch import ArtifactCache, ArtifactSpec, FetchPolicy, FileSpec


def main(arg: str) -> None:
    spec = json.loads(arg)
    artifact = ArtifactSpec(tuple(FileSpec(u, r, n, s) for u, r, n, s in spec["files"]))
    cache = ArtifactCache(Path(spec["root"]), policy=FetchPolicy(disk_margin_bytes=0))
    start = time.perf_counter()
    cache.fetch(artifact)
    print(json.dumps({"fetch_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main(sys.argv[1])
