"""Elastic serving, the control plane's half, with real llama.cpp replicas:
the test acts as the routers (load reports, wakes) against a real Temporal
server, control worker and agent.

- load reports scale a deployment 1 -> 3 and, once the load stops, back to 1;
- idle, it scales to zero and keeps running; 20 concurrent wakes start
  exactly one replica and all answer ready;
- a wake that cannot place answers why, within its placement attempts;
- the control worker SIGKILLed during a wake: the wake completes, one replica;
- a waiting wake holds continue-as-new (it would cut the wake off) until answered.
"""

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import httpx
from temporalio.client import Client, WorkflowExecutionStatus

from llmgw import contracts, replicas
from llmgw.queues import CONTROL_QUEUE, deployment_workflow_id
from llmgw.types import (
    AutoscalePolicy,
    DeploymentInput,
    DeploymentStatus,
    LoadReport,
    ModelLoad,
    ModelSpec,
    ReplicaTimeouts,
    WakeInput,
    WakeResult,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import FAST, System, free_port, wait_deployment
from tests.procs_util import pids_with_args
from tests.recording import record


def _spec(tiny: TinyModel, name: str, policy: AutoscalePolicy, gpus: int = 0) -> ModelSpec:
    return ModelSpec(name=name, source=str(tiny.model_path), gpus=gpus, autoscale=policy)


def _ready(status: DeploymentStatus) -> int:
    return sum(s.ready for s in status.slots)


@contextlib.asynccontextmanager
async def _router_load(client: Client, model: str, inflight: int) -> AsyncIterator[None]:
    """A router reporting ``inflight`` requests twice a second, then a final zero."""
    handle = client.get_workflow_handle(deployment_workflow_id(model))

    async def report(n: int) -> None:
        await contracts.REPORT_LOAD.send(
            handle,
            LoadReport(
                router_id="test-router", load=ModelLoad(model=model, inflight=n, arrivals=n)
            ),
        )

    async def loop() -> None:
        while True:
            await report(inflight)
            await asyncio.sleep(0.5)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await report(0)


async def _wake(client: Client, model: str, router: str) -> WakeResult:
    handle = client.get_workflow_handle(deployment_workflow_id(model))
    return await contracts.WAKE.execute(handle, WakeInput(router_id=router))


async def _running(client: Client, model: str) -> bool:
    desc = await client.get_workflow_handle(deployment_workflow_id(model)).describe()
    return desc.status == WorkflowExecutionStatus.RUNNING


async def test_load_scales_up_to_three_and_back_to_one(
    system: System, client: Client, tiny: TinyModel
) -> None:
    policy = AutoscalePolicy(
        min_replicas=1, max_replicas=3, target_inflight=2,
        scale_up_window_s=1, scale_down_window_s=3, idle_timeout_s=600,
    )  # fmt: skip
    spec = _spec(tiny, "tiny-elastic", policy)
    await system.start(client, "elastic-node")
    # A short history: reports twice a second make it continue as new
    # several times, carrying the load and the decisions.
    first = await contracts.DEPLOYMENT.start(
        client,
        DeploymentInput(model=spec, replicas=1, timeouts=FAST, continue_after_events=60),
        id=deployment_workflow_id(spec.name),
        task_queue=CONTROL_QUEUE,
    )
    await wait_deployment(client, spec.name, lambda s: _ready(s) == 1)

    async with _router_load(client, spec.name, inflight=6):
        up = await wait_deployment(client, spec.name, lambda s: _ready(s) == 3, 180)
    assert up.desired == 3
    assert up.load.routers == 1 and up.load.inflight == 6
    # The zero report: the down window (3 s) must pass without load first.
    down = await wait_deployment(
        client, spec.name, lambda s: s.desired == 1 and len(s.slots) == 1, 120
    )
    assert _ready(down) == 1
    reasons = [d.reason for d in down.decisions]
    assert any(r.startswith("scale 1 -> ") and "target 2" in r for r in reasons), reasons
    assert reasons[-1].startswith("scale 3 -> 1: at most 0.0 in flight per replica over 3 s")
    assert max(d.to_replicas for d in down.decisions) == 3
    now = await client.get_workflow_handle(deployment_workflow_id(spec.name)).describe()
    assert now.run_id != first.result_run_id, "expected continue-as-new under the reports"
    async with asyncio.timeout(60):
        while len(pids_with_args("--alias", spec.name)) != 1:
            await asyncio.sleep(0.2)
    await record(
        client, deployment_workflow_id(spec.name), "deployment_autoscale", first.result_run_id
    )
    await replicas.remove_deployment(client, spec, 60)
    assert pids_with_args("--alias", spec.name) == []


async def test_idle_scales_to_zero_and_twenty_wakes_start_one_replica(
    system: System, client: Client, tiny: TinyModel
) -> None:
    policy = AutoscalePolicy(min_replicas=0, max_replicas=2, idle_timeout_s=2)
    spec = _spec(tiny, "tiny-wake", policy)
    await system.start(client, "wake-node")
    await replicas.apply_deployment(client, spec, 1, timeouts=FAST)
    await wait_deployment(client, spec.name, lambda s: _ready(s) == 1)

    # No request for the idle timeout: drained to zero, on the durable timer.
    idle = await wait_deployment(client, spec.name, lambda s: s.desired == 0 and not s.slots)
    assert "no request for 2 s (idle timeout 2 s)" in idle.decisions[-1].reason
    async with asyncio.timeout(60):
        while pids_with_args("--alias", spec.name):
            await asyncio.sleep(0.2)
    assert await _running(client, spec.name), "an autoscaled deployment at zero keeps running"

    results = await asyncio.gather(*(_wake(client, spec.name, f"r{i % 3}") for i in range(20)))
    assert all(r.ready for r in results), [r.reason for r in results]
    status = await replicas.deployment_status(client, spec.name)
    assert [s.starts for s in status.slots] == [1]
    assert len(pids_with_args("--alias", spec.name)) == 1
    wakes = [d for d in status.decisions if d.reason.startswith("wake: ")]
    assert [(d.from_replicas, d.to_replicas) for d in wakes] == [(0, 1)]
    await record(client, deployment_workflow_id(spec.name), "deployment_scale_to_zero_wake")
    await replicas.remove_deployment(client, spec, 60)


async def _scale_decisions(address: str, model: str) -> list[str]:
    """The control worker's ``llmgw_scale_decisions`` samples of ``model``."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{address}/metrics")).text
    return [
        line for line in text.splitlines()
        if line.startswith("llmgw_scale_decisions") and f'model="{model}"' in line
    ]  # fmt: skip


async def test_a_wake_that_cannot_place_answers_why(
    system: System, client: Client, tiny: TinyModel
) -> None:
    """...and the wake's decision is counted in the control worker's metrics."""
    policy = AutoscalePolicy(min_replicas=0, max_replicas=1)
    spec = _spec(tiny, "tiny-no-room", policy, gpus=8)
    metrics = f"127.0.0.1:{free_port()}"
    system.env["LLMGW_METRICS_ADDRESS"] = metrics
    await system.start(client, "cpu-only-node")
    few = ReplicaTimeouts(place_retry_s=0.2, place_attempts=2)
    await replicas.apply_deployment(client, spec, 0, timeouts=few)
    assert (await replicas.deployment_status(client, spec.name)).desired == 0

    async with asyncio.timeout(60):
        results = await asyncio.gather(*(_wake(client, spec.name, f"r{i}") for i in range(3)))
    for result in results:
        assert not result.ready
        assert "cannot place" in result.reason and "GPU" in result.reason, result.reason
    counted = await _scale_decisions(metrics, spec.name)
    assert any('direction="up"' in line and line.endswith(" 1") for line in counted), counted
    await replicas.remove_deployment(client, spec, 60)


async def test_a_wake_survives_the_control_worker_killed(
    system: System, client: Client, tiny: TinyModel
) -> None:
    policy = AutoscalePolicy(min_replicas=0, max_replicas=2)
    spec = _spec(tiny, "tiny-wake-kill", policy)
    first = system.spawn("control")
    system.spawn("agent", {"LLMGW_NODE_ID": "kill-node"})
    await replicas.wait_node_registered(client, "kill-node", 60)
    await replicas.apply_deployment(client, spec, 0, timeouts=FAST)

    wake = asyncio.create_task(_wake(client, spec.name, "r1"))
    # The wake is in the history and a replica is on its way: kill -9.
    await wait_deployment(client, spec.name, lambda s: any(sl.replica_id for sl in s.slots))
    first.signal(signal.SIGKILL)
    first.proc.wait()
    assert not wake.done()
    system.spawn("control")
    async with asyncio.timeout(180):
        result = await wake
    assert result.ready, result.reason
    status = await replicas.deployment_status(client, spec.name)
    assert [s.starts for s in status.slots] == [1]
    assert len(pids_with_args("--alias", spec.name)) == 1
    await replicas.remove_deployment(client, spec, 60)


async def test_a_waiting_wake_holds_continue_as_new_until_it_answered(
    system: System, client: Client, tiny: TinyModel
) -> None:
    """Reports flood the history past its limit while a wake waits: the run
    goes on until the wake has its answer, then continues as new."""
    policy = AutoscalePolicy(min_replicas=0, max_replicas=1)
    spec = _spec(tiny, "tiny-wake-can", policy, gpus=8)
    await system.start(client, "can-node")
    few = ReplicaTimeouts(place_retry_s=1, place_attempts=3)
    first = await contracts.DEPLOYMENT.start(
        client,
        DeploymentInput(model=spec, replicas=0, timeouts=few, continue_after_events=40),
        id=deployment_workflow_id(spec.name),
        task_queue=CONTROL_QUEUE,
    )
    wake = asyncio.create_task(_wake(client, spec.name, "r1"))
    handle = client.get_workflow_handle(deployment_workflow_id(spec.name))
    async with asyncio.timeout(60):
        while not wake.done():
            await contracts.REPORT_LOAD.send(
                handle,
                LoadReport(router_id="r1", load=ModelLoad(model=spec.name, waiting=1)),
            )
            await asyncio.sleep(0.05)
    result = await wake
    assert not result.ready and "cannot place" in result.reason, result.reason
    # The first run answered it: its history holds the wake's completion.
    events = [e async for e in client.get_workflow_handle(
        deployment_workflow_id(spec.name), run_id=first.result_run_id
    ).fetch_history_events()]  # fmt: skip
    assert any(e.HasField("workflow_execution_update_completed_event_attributes") for e in events)
    assert len(events) > 40
    async with asyncio.timeout(60):
        while (await handle.describe()).run_id == first.result_run_id:
            await contracts.REPORT_LOAD.send(
                handle,
                LoadReport(router_id="r1", load=ModelLoad(model=spec.name)),
            )
            await asyncio.sleep(0.1)
    await replicas.remove_deployment(client, spec, 60)
