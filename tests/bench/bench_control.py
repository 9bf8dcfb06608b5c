"""Control-plane benchmark (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_control [--nodes 500] [--replicas 1000]
        [--callers 1,32] [--starts 20] [--exhaustive]

1. Placement of ``--replicas`` 1-GPU..8-GPU replicas onto ``--nodes``
   simulated 8-GPU nodes: the pure code alone (the placement index the
   Fleet uses; ``--exhaustive`` also times the scorer that rates every node
   and gives reasons), then through the real Fleet workflow on a throwaway
   dev server, once per ``--callers`` count of concurrent callers, each
   going through the control activity's ``Placer`` (requests made while
   others are in flight go as one ``place_batch`` update): placements/s.
2. Orchestration overhead of a replica start, over ``--starts`` starts of the
   tiny model on a real llama.cpp: start-to-ready as the client sees it,
   minus the engine's own load time (process spawned → first successful
   readiness probe, the replica's LOADING → READY), p50 and p95, and where
   the time goes step by step. ``--starts 0`` skips this part.
"""

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle

from activities.control.placer import Placer, fleet_sender
from llmgw import replicas
from llmgw.queues import CONTROL_QUEUE, FLEET_WORKFLOW_ID
from llmgw.temporal import connect
from llmgw.types import (
    FleetSnapshot,
    GpuInfo,
    ModelSpec,
    NodeInventory,
    PlaceBatch,
    PlaceBatchResult,
    Placement,
    PlaceRequest,
    ReplicaPhase,
)
from llmgw_cli.dev.tinymodel import generate_tiny_model
from tests.bench.timing import load_seconds, percentile_ms, phase_at, print_start_figures
from tests.harness import System, free_port, start_devserver
from workflows.placement import choose_node
from workflows.placement_index import PlacementIndex


def _node(i: int) -> NodeInventory:
    return NodeInventory(
        node_id=f"sim-{i:04d}",
        hostname=f"sim-{i:04d}",
        address=f"10.0.{i // 256}.{i % 256}",
        cpu_count=96,
        memory_mib=1024 * 1024,
        gpus=[
            GpuInfo(
                index=g,
                uuid=f"GPU-{i}-{g}",
                name="NVIDIA H100 80GB HBM3",
                memory_mib=81559,
                gpu_class="h100-80g",
            )
            for g in range(8)
        ],
    )


def _models(count: int, seed: int) -> list[ModelSpec]:
    rng = random.Random(seed)
    # A mix like a real fleet: mostly small models, some whole-node ones.
    sizes = rng.choices([1, 2, 4, 8], weights=[50, 25, 15, 10], k=count)
    return [ModelSpec(name=f"m{g}", source="/m", gpus=g) for g in sizes]


def bench_pure(nodes: int, count: int, *, exhaustive: bool = False) -> None:
    inventory = {n.node_id: n for n in map(_node, range(nodes))}
    allocations: dict[str, Placement] = {}
    index = PlacementIndex(inventory)
    models = _models(count, seed=1)
    placed = 0
    began = time.perf_counter()
    for i, model in enumerate(models):
        if exhaustive:
            placement = choose_node(f"r{i}", model, inventory, allocations).placement
        else:
            placement = index.choose(f"r{i}", model)
        if placement is not None:
            allocations[f"r{i}"] = placement
            index.add(f"r{i}", placement)
            placed += 1
    took = time.perf_counter() - began
    used = sum(len(p.gpu_indices) for p in allocations.values())
    how = "exhaustive scorer with reasons (choose_node)" if exhaustive else "indexed (the Fleet's)"
    print(
        f"placement, pure code, {how}: {count} replicas onto {nodes} 8-GPU nodes in "
        f"{took:.3f} s ({took / count * 1e3:.2f} ms each); placed {placed}, "
        f"GPUs used {used}/{nodes * 8}"
    )


async def bench_fleet(
    client: Client, fleet: WorkflowHandle[Any, Any], nodes: int, count: int, callers: int
) -> None:
    began = time.perf_counter()
    await asyncio.gather(*(fleet.signal("register_node", _node(i)) for i in range(nodes)))
    await fleet.query("snapshot", result_type=FleetSnapshot)  # all signals applied
    registered = time.perf_counter() - began
    work = list(enumerate(_models(count, seed=1)))
    placed = 0
    latencies: list[float] = []
    batches: list[int] = []
    send = fleet_sender(client)

    async def counted(batch: PlaceBatch) -> PlaceBatchResult:
        batches.append(len(batch.requests))
        return await send(batch)

    # The control activity's own path: concurrent requests coalesce into
    # place_batch updates.
    placer = Placer(counted)

    async def caller() -> None:
        nonlocal placed
        while work:
            i, model = work.pop(0)
            sent = time.perf_counter()
            result = await placer.place(PlaceRequest(replica_id=f"r{i}", model=model))
            latencies.append(time.perf_counter() - sent)
            placed += result.placement is not None

    began = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    took = time.perf_counter() - began
    p50 = statistics.median(latencies) * 1e3
    print(
        f"placement through the Fleet workflow, {callers} concurrent callers: {nodes} nodes "
        f"registered in {registered:.2f} s; {count} place updates in {took:.2f} s = "
        f"{count / took:.0f} placements/s (a caller waits p50 {p50:.1f} ms; {len(batches)} "
        f"updates, {statistics.mean(batches):.1f} placements each); placed {placed}"
    )


# Each step: from the previous phase change (the client's start call for the
# first) to this one, by the workflow's clock.
STEPS = [
    ("workflow started, placed (Fleet update)", ReplicaPhase.FETCHING),
    ("validated, weights in cache", ReplicaPhase.STARTING),
    ("launched (launch activity)", ReplicaPhase.LOADING),
    ("engine loaded (LOADING -> READY)", ReplicaPhase.READY),
]


async def bench_starts(client: Client, system: System, model: ModelSpec, starts: int) -> None:
    system.spawn("control")
    system.spawn_agent("bench-node")
    await replicas.wait_node_registered(client, "bench-node", 60)
    totals, loads = [], []
    gaps: dict[str, list[float]] = {name: [] for name, _ in STEPS}
    gaps["ready seen by the client"] = []
    for _ in range(starts):
        began, began_at = time.perf_counter(), datetime.now(UTC)
        rid = await replicas.start_replica(client, model)
        await replicas.wait_ready(client, rid, 120, poll_s=0.01)
        total, ended_at = time.perf_counter() - began, datetime.now(UTC)
        status = await replicas.status_of(client, rid)
        assert status is not None
        steps = [(h.phase, h.at) for h in status.history]
        load = load_seconds(steps)
        totals.append(total)
        loads.append(load)
        # Where the time goes, from the phase changes' workflow timestamps.
        last = began_at
        for name, phase in STEPS:
            at = phase_at(steps, phase)
            gaps[name].append((at - last).total_seconds())
            last = at
        gaps["ready seen by the client"].append((ended_at - last).total_seconds())
        await replicas.stop_replica(client, rid, "bench", 60)
    print_start_figures(
        f"replica start, {starts} starts of the tiny model on llama.cpp:",
        totals,
        loads,
        "orchestration overhead",
    )
    print("  where it goes (p50 of each step, ms):")
    for name, values in gaps.items():
        print(f"    {name:40s} {percentile_ms(values, 50):6.0f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument(
        "--callers",
        type=lambda v: [int(c) for c in v.split(",") if c],
        default=[1, 32],
        help="concurrent place callers, one Fleet run each (comma-separated)",
    )
    parser.add_argument(
        "--exhaustive", action="store_true", help="also time the exhaustive scorer (slow)"
    )
    args = parser.parse_args()
    bench_pure(args.nodes, args.replicas)
    if args.exhaustive:
        bench_pure(args.nodes, args.replicas, exhaustive=True)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        root = Path(tmp)
        port = free_port()
        server = start_devserver(root / "temporal.db", port, root / "temporal.log")
        system = System(f"127.0.0.1:{port}", root / "llmgw", free_port())
        system.work_dir.mkdir()
        try:
            client = await connect(f"127.0.0.1:{port}")
            control = None
            for callers in args.callers:
                # A fleet of its own (started before the control worker, which
                # then uses it): the simulated nodes must not meet the real agent.
                fleet = await client.start_workflow(
                    "Fleet", FleetSnapshot(), id=FLEET_WORKFLOW_ID, task_queue=CONTROL_QUEUE
                )
                control = control or system.spawn("control")
                await bench_fleet(client, fleet, args.nodes, args.replicas, callers)
                await fleet.terminate("bench: next part")
            if control is not None:
                control.stop()
            if args.starts > 0:
                tiny = generate_tiny_model(root / "tiny")
                model = ModelSpec(name="tiny-bench", source=str(tiny.model_path))
                await bench_starts(client, system, model, args.starts)
        finally:
            system.stop()
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
