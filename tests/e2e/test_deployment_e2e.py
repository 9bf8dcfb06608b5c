"""Deployments with real engines: preemption, restart backoff and reaping."""

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.queues import CONTROL_QUEUE, deployment_workflow_id, replica_workflow_id
from llmgw.store import Store
from llmgw.types import (
    DeploymentInput,
    EngineKind,
    EngineProfile,
    ModelSpec,
    ReplicaPhase,
    RestartPolicy,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import FAST, System, wait_deployment
from tests.procs_util import pids_with_args
from tests.recording import record


async def test_higher_priority_preempts_lower_and_both_sides_record_it(
    system: System, client: Client, tiny: TinyModel
) -> None:
    low = ModelSpec(name="tiny-low", source=str(tiny.model_path), priority=0)
    high = ModelSpec(name="tiny-high", source=str(tiny.model_path), priority=5)
    system.spawn("control")
    # One CPU replica slot: the high-priority model only fits if the low goes.
    system.spawn_agent("pre-node", {"LLMGW_MAX_CPU_REPLICAS": "1"})
    await replicas.wait_node_registered(client, "pre-node", 60)
    policy = RestartPolicy(initial_backoff_s=0.2)
    await replicas.apply_deployment(client, low, 1, timeouts=FAST, restart=policy)
    victim = await replicas.wait_deployment_ready(client, low.name, 120)
    system.catalog(low, high)
    explained = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "llmgw_cli", "explain", high.name],
        env=system.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert f"priority 5 would preempt {victim.replica_id} on pre-node" in explained.stdout, (
        explained.stdout + explained.stderr
    )

    await replicas.apply_deployment(client, high, 1, timeouts=FAST, restart=policy)
    winner = await replicas.wait_deployment_ready(client, high.name, 120)
    # Jobs are listed by model and state (what the Temporal UI filters on).
    query = (
        f"WorkflowType = 'Deployment' AND ReplicaModel = '{high.name}' AND ReplicaState = 'steady'"
    )
    async with asyncio.timeout(30):
        while not [wf.id async for wf in client.list_workflows(query)]:
            await asyncio.sleep(0.2)

    gone = await replicas.status_of(client, victim.replica_id)
    assert gone is not None and gone.phase is ReplicaPhase.STOPPED
    assert gone.preempted_by == winner.replica_id
    assert any(
        h.phase is ReplicaPhase.DRAINING and f"preempted by {winner.replica_id}" in h.detail
        for h in gone.history
    )
    won = await replicas.status_of(client, winner.replica_id)
    assert won is not None and won.preempting == [victim.replica_id]
    assert any(f"preempting {victim.replica_id}" in h.detail for h in won.history)
    records = (await replicas.fleet_snapshot(client)).preemptions
    assert [(r.preemptor, r.victim, r.node_id) for r in records] == [
        (winner.replica_id, victim.replica_id, "pre-node")
    ]
    # The low model's slot is not counted as failing; its replacement waits for room.
    waiting = await wait_deployment(
        client,
        low.name,
        lambda s: s.slots[0].replica_id not in ("", victim.replica_id),
    )
    slot = waiting.slots[0]
    assert slot.preempted_by == winner.replica_id and slot.consecutive_failures == 0
    assert len(pids_with_args("--alias", high.name)) == 1
    assert pids_with_args("--alias", low.name) == []

    # Room freed: the low model comes back on its own.
    await replicas.remove_deployment(client, high, 60)
    back = await replicas.wait_deployment_ready(client, low.name, 120)
    assert back.replica_id == slot.replica_id
    await replicas.remove_deployment(client, low, 60)
    assert pids_with_args("--alias", low.name) == []
    await record(client, replica_workflow_id(winner.replica_id), "replica_preemptor")
    await record(client, replica_workflow_id(victim.replica_id), "replica_preempted")
    await record(client, deployment_workflow_id(low.name), "deployment_preempted")


async def test_a_two_node_replica_preempts_a_replica_on_each_of_its_nodes(
    system: System, client: Client, tiny: TinyModel, rpc_llama_env: dict[str, str]
) -> None:
    """Multi-node preemption with real engines: two nodes of one island with
    one CPU slot each, both taken by low-priority replicas; a priority-5
    two-node llama.cpp replica (rpc) drains one victim per node, runs on
    both, and when it goes the low replicas come back."""
    low = ModelSpec(name="tiny-low-mn", source=str(tiny.model_path), priority=0)
    wide = ModelSpec(
        name="tiny-wide",
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        priority=5,
        profile=EngineProfile(nodes=2),
    )
    system.spawn("control")
    for node in ("pmn-a", "pmn-b"):
        system.spawn_agent(node, {"LLMGW_MAX_CPU_REPLICAS": "1", **rpc_llama_env})
        await replicas.wait_node_registered(client, node, 60)
    policy = RestartPolicy(initial_backoff_s=0.2)
    await replicas.apply_deployment(client, low, 2, timeouts=FAST, restart=policy)
    lows = await wait_deployment(client, low.name, lambda s: sum(sl.ready for sl in s.slots) == 2)
    victims = {sl.replica_id: sl.node_id for sl in lows.slots}
    assert sorted(victims.values()) == ["pmn-a", "pmn-b"]
    system.catalog(low, wide)
    explained = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "llmgw_cli", "explain", wide.name],
        env=system.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "priority 5 would preempt" in explained.stdout, explained.stdout + explained.stderr
    assert "on pmn-a, pmn-b" in explained.stdout, explained.stdout

    await replicas.apply_deployment(client, wide, 1, timeouts=FAST, restart=policy)
    winner = await replicas.wait_deployment_ready(client, wide.name, 180)
    fleet = await replicas.fleet_snapshot(client)
    placed = fleet.allocations[winner.replica_id]
    assert sorted(s.node_id for s in placed.shards()) == ["pmn-a", "pmn-b"]
    mine = [r for r in fleet.preemptions if r.preemptor == winner.replica_id]
    assert sorted((r.victim, r.node_id) for r in mine) == sorted(victims.items())
    for victim in victims:
        gone = await replicas.status_of(client, victim)
        assert gone is not None and gone.phase is ReplicaPhase.STOPPED
        assert gone.preempted_by == winner.replica_id
    won = await replicas.status_of(client, winner.replica_id)
    assert won is not None and sorted(won.preempting) == sorted(victims)
    assert len(pids_with_args("ggml-rpc-server", "-p")) == 1
    assert len(pids_with_args("--alias", wide.name, "--rpc")) == 1
    assert pids_with_args("--alias", low.name) == []

    # Room freed: both low replicas come back on their own.
    await replicas.remove_deployment(client, wide, 60)
    await wait_deployment(client, low.name, lambda s: sum(sl.ready for sl in s.slots) == 2, 180)
    await replicas.remove_deployment(client, low, 60)
    assert pids_with_args("--alias", low.name) == []
    assert pids_with_args("ggml-rpc-server", "-p") == []
    await record(client, replica_workflow_id(winner.replica_id), "replica_preemptor_multi_node")


async def test_crashing_engine_restarts_with_backoff_then_is_reaped(
    system: System, client: Client, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)  # a header and nothing llama.cpp can load
    spec = ModelSpec(name="tiny-crashloop", engine=EngineKind.LLAMA_CPP, source=str(broken))
    system.spawn("control")
    system.spawn_agent("crash-node")
    await replicas.wait_node_registered(client, "crash-node", 60)
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=10, max_consecutive_failures=3)
    await replicas.apply_deployment(client, spec, 1, timeouts=FAST, restart=policy)

    status = await wait_deployment(client, spec.name, lambda s: bool(s.slots) and s.slots[0].reaped)
    # The reaped slot keeps its place: no new slot restarts the crash loop (a
    # replacement would have been added in the same workflow task as the reap).
    assert len(status.slots) == 1, status.slots
    slot = status.slots[0]
    assert slot.starts == 3 and slot.consecutive_failures == 3
    assert "exit" in slot.last_reason
    assert slot.last_log_tail, "the engine's last words are kept with the reaped slot"
    final = await replicas.status_of(client, slot.replica_id)
    assert final is not None and final.phase is ReplicaPhase.FAILED

    # The waits between starts are the deployment's timers: 0.5 s, then 1 s.
    handle = client.get_workflow_handle(deployment_workflow_id(spec.name))
    timers = [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
        async for e in handle.fetch_history_events()
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]
    assert timers == [0.5, 1.0]
    assert pids_with_args("--alias", spec.name) == []
    await replicas.remove_deployment(client, spec, 60)
    await record(client, deployment_workflow_id(spec.name), "deployment_crashloop_reaped_holds")
    await record(client, replica_workflow_id(slot.replica_id), "replica_engine_exit")


async def test_long_lived_deployment_continues_as_new_and_keeps_its_replicas(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(name="tiny-can", source=str(tiny.model_path))
    system.spawn("control")
    system.spawn_agent("can-node")
    await replicas.wait_node_registered(client, "can-node", 60)
    # A tiny history limit, so that this deployment continues as new within seconds.
    handle = await client.start_workflow(
        "Deployment",
        DeploymentInput(model=spec, replicas=2, timeouts=FAST, continue_after_events=12),
        id=deployment_workflow_id(spec.name),
        task_queue=CONTROL_QUEUE,
    )
    first_run = handle.first_execution_run_id or handle.result_run_id
    before = await wait_deployment(
        client, spec.name, lambda s: len(s.slots) == 2 and all(x.ready for x in s.slots)
    )
    runs = [wf.run_id async for wf in client.list_workflows(f"WorkflowId = '{handle.id}'")]
    assert len(runs) >= 2 and first_run in runs, "the deployment continued as new"
    for slot in before.slots:
        memo = await replicas.replica_memo(client, slot.replica_id)
        assert memo is not None and memo.phase is ReplicaPhase.READY  # not cancelled by it

    # A replica an earlier run started ends: the current run hears of it and replaces it.
    victim = before.slots[0]
    await replicas.stop_replica(client, victim.replica_id, "test: stop one", 60)
    after = await wait_deployment(
        client,
        spec.name,
        lambda s: any(
            x.slot == victim.slot and x.replica_id != victim.replica_id and x.ready for x in s.slots
        ),
    )
    replaced = next(x for x in after.slots if x.slot == victim.slot)
    assert replaced.starts == victim.starts + 1
    assert len(pids_with_args("--alias", spec.name)) == 2

    # Cancelling the deployment drains every replica, whichever run started it.
    await client.get_workflow_handle(handle.id).cancel()
    async with asyncio.timeout(60):
        while pids_with_args("--alias", spec.name):
            await asyncio.sleep(0.2)
    async with asyncio.timeout(60):
        for slot in after.slots:
            while (final := await replicas.status_of(client, slot.replica_id)) is None or (
                final.phase is not ReplicaPhase.STOPPED
            ):
                await asyncio.sleep(0.2)
    await record(client, handle.id, "deployment_continued_as_new", run_id=first_run)
    await record(client, handle.id, "deployment_cancelled")


async def test_scale_down_drains_the_least_loaded_replica(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(
        name="tiny-least-loaded",
        source=str(tiny.model_path),
        context_length=2048,
        engine_args=["--parallel", "1"],
    )
    system.spawn("control")
    system.spawn_agent("load-node")
    await replicas.wait_node_registered(client, "load-node", 60)
    await replicas.apply_deployment(client, spec, 2, timeouts=FAST)
    both = await wait_deployment(
        client, spec.name, lambda s: len(s.slots) == 2 and all(x.ready for x in s.slots)
    )
    # Load the newest replica: "newest first" would have drained it.
    busy = max(both.slots, key=lambda s: s.slot)
    idle = min(both.slots, key=lambda s: s.slot)
    memo = await replicas.replica_memo(client, busy.replica_id)
    assert memo is not None
    store = Store(system.store_url)
    key = engine_key(store.engine_key_secret(), busy.replica_id)
    store.close()
    body = {"prompt": "hi", "max_tokens": 1500, "stream": True}
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream(
            "POST", f"{memo.endpoint}/v1/completions", json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as stream,
    ):  # fmt: skip
        lines = stream.aiter_lines()
        await anext(lines)  # generating
        await replicas.apply_deployment(client, spec, 1, timeouts=FAST)
        after = await wait_deployment(client, spec.name, lambda s: len(s.slots) == 1)
        assert after.slots[0].replica_id == busy.replica_id
        chunks = [line async for line in lines if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]", "the busy replica's stream ran to its end"
    gone = await replicas.status_of(client, idle.replica_id)
    assert gone is not None and gone.reason == "scaled down"
    await replicas.remove_deployment(client, spec, 60)
    await record(client, deployment_workflow_id(spec.name), "deployment_scale_down_least_loaded")
