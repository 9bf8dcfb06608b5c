"""Wake-from-zero benchmark (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_wake [--wakes 10]

An autoscaled deployment of the tiny model on a real llama.cpp (min 0,
idle timeout 1 s) is left to scale to zero, then woken through the
``wake`` update, as a router holding a request does, ``--wakes`` times.
Printed: wake-to-ready as the caller sees it (the update's answer), the
engine's own load (its replica's LOADING -> READY), and the orchestration
part of a wake (the difference: the update, the decision, the replica's
placement, fetch check and launch), p50 and p95. The router's own part
(queueing the request, calling the update) is not in it.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from temporalio.client import Client

from llmgw import messages, replicas
from llmgw.dev.tinymodel import generate_tiny_model
from llmgw.queues import deployment_workflow_id
from llmgw.temporal import connect
from llmgw.types import (
    AutoscalePolicy,
    ModelSpec,
    ReplicaPhase,
    ReplicaTimeouts,
    WakeInput,
    WakeResult,
)
from tests.harness import System, free_port, start_devserver, wait_deployment


def _at(history: list[tuple[ReplicaPhase, str]], phase: ReplicaPhase) -> datetime:
    return next(datetime.fromisoformat(at) for p, at in history if p is phase)


async def bench_wakes(client: Client, system: System, model: ModelSpec, wakes: int) -> None:
    system.spawn("control")
    system.spawn_agent("bench-node")
    await replicas.wait_node_registered(client, "bench-node", 60)
    fast = ReplicaTimeouts(router_grace_s=0.1, drain_s=5)
    await replicas.apply_deployment(client, model, 0, timeouts=fast)
    handle = client.get_workflow_handle(deployment_workflow_id(model.name))
    totals, loads = [], []
    for i in range(wakes):
        await wait_deployment(client, model.name, lambda s: s.desired == 0 and not s.slots)
        began = time.perf_counter()
        woken: WakeResult = await handle.execute_update(
            messages.WAKE, WakeInput(router_id="bench", reason=f"bench {i}"), result_type=WakeResult
        )
        total = time.perf_counter() - began
        assert woken.ready, woken.reason
        status = await replicas.deployment_status(client, model.name)
        replica = await replicas.status_of(client, status.slots[0].replica_id)
        assert replica is not None
        steps = [(h.phase, h.at) for h in replica.history]
        loads.append(
            (_at(steps, ReplicaPhase.READY) - _at(steps, ReplicaPhase.LOADING)).total_seconds()
        )
        totals.append(total)
    overhead = [t - lo for t, lo in zip(totals, loads, strict=True)]

    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3

    print(f"wake from zero, {wakes} wakes of the tiny model on llama.cpp:")
    print(f"  wake-to-ready          p50 {p(totals, 50):7.0f} ms  p95 {p(totals, 95):7.0f} ms")
    print(f"  engine's own load      p50 {p(loads, 50):7.0f} ms  p95 {p(loads, 95):7.0f} ms")
    print(f"  orchestration of wake  p50 {p(overhead, 50):7.0f} ms  p95 {p(overhead, 95):7.0f} ms")
    await replicas.remove_deployment(client, model, 60)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wakes", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        root = Path(tmp)
        port = free_port()
        server = start_devserver(root / "temporal.db", port, root / "temporal.log")
        system = System(f"127.0.0.1:{port}", root / "llmgw", free_port())
        system.work_dir.mkdir()
        try:
            client = await connect(f"127.0.0.1:{port}")
            tiny = generate_tiny_model(root / "tiny")
            policy = AutoscalePolicy(min_replicas=0, max_replicas=1, idle_timeout_s=1)
            model = ModelSpec(name="tiny-wake-bench", source=str(tiny.model_path), autoscale=policy)
            await bench_wakes(client, system, model, args.wakes)
        finally:
            system.stop()
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
