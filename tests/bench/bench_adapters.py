"""Adapter routing benchmark (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_adapters [--requests 20000] [--seed 1]

A discrete-event simulation of the router's adapter policy
(router/control_link/adapter_policy.py, the same code the router runs) on a Zipf workload:
50 adapters, 4 replicas, at most N = 4 adapters loaded per replica, a
per-replica in-flight cap, Poisson arrivals, exponential service times and a
fixed adapter load time. A request nobody can take waits (FIFO) until a
replica frees up. Printed for the policy and for naive "prefer the replica
that has it" routing: loads, hit ratio, added latency of cold requests over
the load time (p50/p99: queueing and waiting on a busy replica), every
request's wait, and the busiest replica's share of requests.
"""

import argparse
import heapq
import itertools
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.control_link.adapter_policy import (
    Action,
    AdapterUse,
    Choice,
    ReplicaView,
    choose,
    choose_naive,
)

Policy = Callable[[str, Sequence[ReplicaView]], Choice | None]


@dataclass
class Stats:
    """What one simulated run measured."""

    loads: int = 0
    hits: int = 0
    cold_extra: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    served_by: dict[str, int] = field(default_factory=dict)


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    kind: str = field(compare=False)
    request: int = field(compare=False)


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


class Simulation:
    """One run of a policy over the workload ``args`` describes."""

    def __init__(self, policy: Policy, args: argparse.Namespace) -> None:
        self.policy = policy
        self.args = args
        self.rng = random.Random(args.seed)
        self.adapters = [f"lora-{i:02d}" for i in range(args.adapters)]
        self.weights = _zipf_weights(args.adapters, args.zipf)
        self.replicas = [
            ReplicaView(f"r{i}", cap=args.cap, max_loaded=args.max_loaded)
            for i in range(args.replicas)
        ]
        self.by_id = {r.replica_id: r for r in self.replicas}
        self.stats = Stats(served_by={r.replica_id: 0 for r in self.replicas})
        self.events: list[_Event] = []
        self.seq = itertools.count()
        self.arrive: dict[int, float] = {}
        self.wanted: dict[int, str] = {}
        self.where: dict[int, str] = {}

    def run(self) -> Stats:
        now = 0.0
        for i in range(self.args.requests):
            now += self.rng.expovariate(self.args.rate)
            heapq.heappush(self.events, _Event(now, next(self.seq), "arrive", i))
        waiting: list[int] = []
        while self.events:
            event = heapq.heappop(self.events)
            if event.kind == "arrive":
                self.arrive[event.request] = event.at
                self.wanted[event.request] = self.rng.choices(self.adapters, self.weights)[0]
                if waiting or not self._dispatch(event.request, event.at):
                    waiting.append(event.request)
                continue
            r = self.by_id[self.where[event.request]]
            r.in_flight -= 1
            r.loaded[self.wanted[event.request]].in_flight -= 1
            # Serve waiting requests in order while someone can take them.
            while waiting and self._dispatch(waiting[0], event.at):
                waiting.pop(0)
        return self.stats

    def _dispatch(self, i: int, t: float) -> bool:
        adapter = self.wanted[i]
        choice = self.policy(adapter, self.replicas)
        if choice is None:
            return False
        r = self.by_id[choice.replica_id]
        delay = 0.0
        if choice.action is Action.USE:
            self.stats.hits += 1
        else:
            if choice.evict is not None:
                del r.loaded[choice.evict]
            r.loaded[adapter] = AdapterUse(last_used=t)
            self.stats.loads += 1
            delay = self.args.load_s
            self.stats.cold_extra.append(t - self.arrive[i])  # time beyond the load itself
        use = r.loaded[adapter]
        use.in_flight += 1
        use.last_used = t
        r.in_flight += 1
        self.where[i] = r.replica_id
        self.stats.served_by[r.replica_id] += 1
        self.stats.waits.append(t - self.arrive[i] + delay)
        done = t + delay + self.rng.expovariate(1.0 / self.args.service_s)
        heapq.heappush(self.events, _Event(done, next(self.seq), "done", i))
        return True


def _p(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] * 1e3 if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


def report(name: str, stats: Stats, total: int) -> None:
    busiest = max(stats.served_by.values()) / total
    print(
        f"{name:<22} loads {stats.loads:6d}  hit ratio {stats.hits / total:6.1%}  "
        f"cold extra p50 {_p(stats.cold_extra, 50):7.1f} ms "
        f"p99 {_p(stats.cold_extra, 99):8.1f} ms  "
        f"wait p50 {_p(stats.waits, 50):7.1f} ms p99 {_p(stats.waits, 99):8.1f} ms  "
        f"busiest replica {busiest:5.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--max-loaded", type=int, default=4)
    parser.add_argument("--cap", type=int, default=8, help="in-flight cap per replica")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--rate", type=float, default=16.0, help="requests per second")
    parser.add_argument("--service-s", type=float, default=1.0)
    parser.add_argument("--load-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(
        f"{args.requests} requests, Zipf s={args.zipf} over {args.adapters} adapters, "
        f"{args.replicas} replicas x N={args.max_loaded} loaded, cap {args.cap} in flight, "
        f"{args.rate:g} req/s, service {args.service_s:g} s, load {args.load_s:g} s"
    )
    report("llmgw policy", Simulation(choose, args).run(), args.requests)
    report("naive affinity", Simulation(choose_naive, args).run(), args.requests)


if __name__ == "__main__":
    main()
