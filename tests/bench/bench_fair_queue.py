"""The admission queue's own cost (a script, not a test): prints figures, asserts nothing.

    .venv/bin/python tests/bench/bench_fair_queue.py [--waiting 10000] [--keys 100]

Pushes ``--waiting`` requests from ``--keys`` keys (random costs, weights
and classes) into a FairQueue, then pops them all; prints microseconds per
push and per pop.
"""

import argparse
import random
import time

from llmgw.types import Priority
from router.admission.fair_queue import FairQueue


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--waiting", type=int, default=10_000)
    p.add_argument("--keys", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rnd = random.Random(args.seed)
    keys = [(k, rnd.choice([1.0, 1.0, 2.0]), rnd.choice(list(Priority))) for k in range(args.keys)]
    # Skewed: a few keys send most requests.
    picks = [
        (keys[min(int(rnd.paretovariate(1.2)) - 1, args.keys - 1)], rnd.randint(50, 2000))
        for _ in range(args.waiting)
    ]
    q: FairQueue[int] = FairQueue()
    started = time.perf_counter()
    for i, ((key, weight, priority), cost) in enumerate(picks):
        q.push(i, key, cost, weight, priority)
    pushed = time.perf_counter()
    n = 0
    while q.pop() is not None:
        n += 1
    popped = time.perf_counter()
    per_push = (pushed - started) / args.waiting * 1e6
    per_pop = (popped - pushed) / n * 1e6
    print(
        f"{args.waiting} waiting from {args.keys} keys: "
        f"push {per_push:.2f} us, pop {per_pop:.2f} us"
    )


if __name__ == "__main__":
    main()
