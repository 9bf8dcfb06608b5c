"""Benchmark (not a test): cost of a quota reservation, the one store write a
request of a key with quotas waits for.

    python -m tests.bench.quota_reserve [--store-url URL] [-n 2000] [--threads 1,4]

Prints ms per reservation and reservations per second, sequential and with
threads racing on one key (as router worker threads do). Default store: a
fresh SQLite file.
"""

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from llmgw.store import Store
from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from router.billing.quotas import Limits, Quotas


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-url", default="")
    parser.add_argument("-n", type=int, default=2000)
    parser.add_argument("--threads", default="1,4")
    args = parser.parse_args()
    url = args.store_url or f"sqlite:///{tempfile.mkdtemp()}/bench.db"
    store = Store(url)
    store.migrate()
    info, _ = create_key(store, "bench", KeyPolicy(rpm=2**31 - 1))
    quotas, limits = Quotas(store), Limits(rpm=2**31 - 1)
    quotas.reserve(info.id, limits, 100, time.time())  # warm: connection, compiled statement
    print(f"store: {url.split(':', 1)[0]}, {args.n} reservations per run")
    for threads in (int(t) for t in args.threads.split(",")):
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(lambda _: quotas.reserve(info.id, limits, 100, time.time()), range(args.n))
            )
        took = time.perf_counter() - started
        print(
            f"  {threads} thread(s): {took / args.n * 1e3:.3f} ms per reservation, "
            f"{args.n / took:.0f} reservations/s"
        )
    store.close()


if __name__ == "__main__":
    main()
