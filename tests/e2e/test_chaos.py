"""Chaos loop: SIGKILL the control worker at a random point of a replica start,
a scale-down or a drain, restart it, and check that nothing was lost.

After every trial: each replica ends in its intended state, no engine was
launched twice (the agent logs every launch), and the fleet's ledger equals
the engines actually running. The seed is printed; set LLMGW_CHAOS_SEED to
replay a failing sequence.
"""

import asyncio
import os
import random
import re
import signal
from dataclasses import dataclass, field

from temporalio.client import Client

from llmgw import replicas
from llmgw.types import ModelSpec, ReplicaPhase, ReplicaTimeouts, RestartPolicy
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child
from tests.harness import System
from tests.procs_util import pids_with_args

MODEL = "tiny-chaos"
NODE = "chaos-node"
TRIALS = 10
TIMEOUTS = ReplicaTimeouts(router_grace_s=0.3, drain_s=5, place_retry_s=0.5)
LAUNCH_LINE = re.compile(r"shard (\S+) started: pid")


@dataclass
class World:
    """What the test intends, to compare against what runs."""

    desired: int = 1
    stopped: list[str] = field(default_factory=list)


async def _converged(client: Client, world: World) -> list[str]:
    """Every way the system differs from the intent (empty: converged)."""
    problems = []
    status = await replicas.deployment_status(client, MODEL)
    live = [s for s in status.slots if not s.reaped]
    if len(live) != world.desired or not all(s.ready for s in live):
        problems.append(f"slots {[(s.replica_id, s.ready) for s in status.slots]}")
    serving = {s.replica_id for s in live}
    for rid in world.stopped:
        final = await replicas.status_of(client, rid)
        if final is None or final.phase is not ReplicaPhase.STOPPED:
            problems.append(f"{rid} is {final.phase if final else None}, not stopped")
    engines = pids_with_args("--alias", MODEL)
    if len(engines) != world.desired:
        problems.append(f"{len(engines)} engines for {world.desired} replicas")
    fleet = await replicas.fleet_snapshot(client)
    ledger = {r for r, a in fleet.allocations.items() if a.model == MODEL}
    reported = {s.replica_id for s in fleet.nodes[NODE].running if s.model == MODEL}
    if not ledger == reported == serving:
        problems.append(f"ledger {ledger} / running {reported} / serving {serving}")
    return problems


def _launches(system: System) -> list[str]:
    keys: list[str] = []
    for log in (system.work_dir / "logs").glob("agent-*.log"):
        keys += LAUNCH_LINE.findall(log.read_text(errors="replace"))
    return keys


async def _kill_and_restart(system: System, control: Child) -> Child:
    control.signal(signal.SIGKILL)
    await asyncio.to_thread(control.proc.wait)
    return system.spawn("control")


async def test_chaos_control_worker_killed_at_random_points(
    system: System, client: Client, tiny: TinyModel
) -> None:
    seed = int(os.environ.get("LLMGW_CHAOS_SEED") or random.SystemRandom().randrange(10**6))
    print(f"chaos seed {seed}")
    rng = random.Random(seed)
    spec = ModelSpec(name=MODEL, source=str(tiny.model_path))
    control = system.spawn("control")
    system.spawn_agent(NODE, {"LLMGW_REGISTER_INTERVAL_S": "0.5"})
    await replicas.wait_node_registered(client, NODE, 60)
    restart = RestartPolicy(initial_backoff_s=0.2)
    world = World()
    await replicas.apply_deployment(client, spec, world.desired, TIMEOUTS, restart)
    await replicas.wait_deployment_ready(client, MODEL, 120)

    # Each kind of operation TRIALS // 3 times or more, in a random order.
    kinds = ["start", "scale_down", "drain"]
    schedule = kinds * (TRIALS // 3) + [rng.choice(kinds) for _ in range(TRIALS % 3)]
    rng.shuffle(schedule)
    loop = asyncio.get_running_loop()
    for trial, planned in enumerate(schedule):
        op = planned
        if op == "scale_down" and world.desired == 1:
            op = "start"
        elif op == "start" and world.desired == 3:  # with the drain's, the node's 4 slots
            op = "scale_down"
        kill_after = rng.uniform(0.0, 2.0)
        stopping: asyncio.Task[object] | None = None
        if op in ("start", "scale_down"):
            world.desired += 1 if op == "start" else -1
            await replicas.apply_deployment(client, spec, world.desired, TIMEOUTS, restart)
        else:
            rid = await replicas.start_replica(client, spec, TIMEOUTS)
            await replicas.wait_ready(client, rid, 120)
            stopping = asyncio.create_task(replicas.stop_replica(client, rid, "chaos", 120))
        # A random point of the operation: this sleep is the experiment's
        # variable, not a wait for something to happen.
        await asyncio.sleep(kill_after)
        control = await _kill_and_restart(system, control)
        if stopping is not None:
            await stopping
            world.stopped.append(rid)
        deadline = loop.time() + 90
        problems = ["not checked yet"]
        while problems and loop.time() < deadline:
            try:
                problems = await _converged(client, world)
            except Exception as exc:  # the fresh worker may not answer queries yet
                problems = [repr(exc)]
            if problems:
                await asyncio.sleep(0.3)
        where = f"trial {trial} ({op} killed after {kill_after:.2f}s, seed {seed})"
        assert not problems, f"{where}: {problems}"
        launches = _launches(system)
        twice = sorted({k for k in launches if launches.count(k) > 1})
        assert not twice, f"{where}: launched twice: {twice}"

    await replicas.remove_deployment(client, spec, 60)
    assert pids_with_args("--alias", MODEL) == []
