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
import tempfile
import time
from pathlib import Path

from temporalio.client import Client

from llmgw import contracts, replicas
from llmgw.queues import deployment_workflow_id
from llmgw.temporal import connect
from llmgw.types import (
    AutoscalePolicy,
    ModelSpec,
    ReplicaTimeouts,
    WakeInput,
    WakeResult,
)
from llmgw_cli.dev.tinymodel import generate_tiny_model
from tests.bench.timing import load_seconds, print_start_figures
from tests.harness import System, free_port, start_devserver, wait_deployment


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
        woken: WakeResult = await contracts.WAKE.execute(
            handle, WakeInput(router_id="bench", reason=f"bench {i}")
        )
        total = time.perf_counter() - began
        assert woken.ready, woken.reason
        status = await replicas.deployment_status(client, model.name)
        replica = await replicas.status_of(client, status.slots[0].replica_id)
        assert replica is not None
        steps = [(h.phase, h.at) for h in replica.history]
        loads.append(load_seconds(steps))
        totals.append(total)
    print_start_figures(
        f"wake from zero, {wakes} wakes of the tiny model on llama.cpp:",
        totals,
        loads,
        "orchestration of wake",
    )
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
