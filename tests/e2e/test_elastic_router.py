"""Elastic serving with both halves together: a real router (its admission
queue, load reports and wakes over Temporal) in front of the real Deployment
workflow, control worker, agent and llama.cpp replicas, driven by the
official openai client.

- a burst through the router scales 1 -> 3 and, once it stops, back to 1;
  every request is answered 200;
- idle, the model goes to zero and stays listed; 20 concurrent requests
  (some streamed) are all answered after one wake that starts one replica;
- the control worker SIGKILLed during a router's wake: the waiting requests
  are still answered, one replica;
- a wake that cannot place answers the waiting requests with an OpenAI error
  and an error id whose reason is in the router's log, and so does a wake of
  a deployment that has ended.
"""

import asyncio
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import openai
import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from llmgw import replicas
from llmgw.queues import deployment_workflow_id
from llmgw.types import (
    AutoscalePolicy,
    DeploymentStatus,
    EngineProfile,
    ModelSpec,
    QueuePolicy,
    ReplicaTimeouts,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import FAST, System, free_port, wait_deployment
from tests.procs_util import pids_with_args

# Generous: a wake on two shared cores can take a while; a hang still fails.
QUEUE = QueuePolicy(max_waiting=64, max_wait_s=150)


def _spec(tiny: TinyModel, name: str, policy: AutoscalePolicy | None, gpus: int = 0) -> ModelSpec:
    return ModelSpec(
        name=name,
        source=str(tiny.model_path),
        gpus=gpus,
        context_length=2048,
        profile=EngineProfile(max_inflight=1),
        autoscale=policy,
        queue=QUEUE,
    )


def _ready(status: DeploymentStatus) -> int:
    return sum(s.ready for s in status.slots)


OpenAIFor = Callable[[str, str], openai.AsyncOpenAI]


@pytest.fixture
async def oai_for() -> AsyncIterator[OpenAIFor]:
    """openai clients (base URL, key), no retries, closed after the test."""
    made: list[openai.AsyncOpenAI] = []

    def make(base: str, key: str) -> openai.AsyncOpenAI:
        made.append(openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=300))
        return made[-1]

    yield make
    for oai in made:
        await oai.close()


async def _complete(oai: openai.AsyncOpenAI, model: str, i: int) -> str:
    """One request, streamed when ``i`` is odd; its text (raises on an error)."""
    if i % 2:
        stream = await oai.completions.create(
            model=model, prompt=f"Count {i}", max_tokens=8, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])
    done = await oai.completions.create(model=model, prompt=f"Count {i}", max_tokens=8)
    return done.choices[0].text


async def _outcome(call: Awaitable[str]) -> str:
    """ "200", or what the router answered instead."""
    try:
        await call
    except openai.APIError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "200"


async def _models(base: str, key: str) -> dict[str, str]:
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return {m["id"]: m["llmgw_state"] for m in r.json()["data"]}


async def _until(ok: Callable[[], Awaitable[bool]], timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while not await ok():
            await asyncio.sleep(0.2)


async def _replica_workflows(client: Client, model: str) -> set[str]:
    query = f"WorkflowType = 'Replica' AND ReplicaModel = '{model}'"
    return {wf.id async for wf in client.list_workflows(query)}


@pytest.mark.timeout(600)
async def test_a_burst_through_the_router_scales_to_three_and_back(
    system: System, client: Client, tiny: TinyModel, oai_for: OpenAIFor
) -> None:
    policy = AutoscalePolicy(
        min_replicas=1, max_replicas=3, target_inflight=1,
        scale_up_window_s=1, scale_down_window_s=4, idle_timeout_s=3600,
    )  # fmt: skip
    spec = _spec(tiny, "tiny-burst", policy)
    key = system.catalog(spec)
    started = await system.start(client, "burst-node")
    await replicas.apply_deployment(client, spec, 1, timeouts=FAST)
    await wait_deployment(client, spec.name, lambda s: _ready(s) == 1)
    oai = oai_for(started.base, key)
    await _until(lambda: _listed_as(started.base, key, spec.name, "ready"))

    stop = asyncio.Event()
    outcomes: list[str] = []

    async def worker(w: int) -> None:
        i = w
        while not stop.is_set():
            outcomes.append(await _outcome(_complete(oai, spec.name, i)))
            i += 6

    # Six requests always under way against one slot per replica: the
    # router's reports (in flight + waiting) ask for 6 per replica at target 1.
    workers = [asyncio.create_task(worker(w)) for w in range(6)]
    try:
        up = await wait_deployment(client, spec.name, lambda s: _ready(s) == 3, 240)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert up.desired == 3 and up.load.routers == 1
    # The router reports the load's end; the down window passes; drained to 1.
    down = await wait_deployment(
        client, spec.name, lambda s: s.desired == 1 and len(s.slots) == 1, 180
    )
    assert _ready(down) == 1
    assert outcomes and set(outcomes) == {"200"}, [o for o in outcomes if o != "200"]
    reasons = [d.reason for d in down.decisions]
    assert any(r.startswith("scale 1 -> ") for r in reasons), reasons
    # Down to 1 from the peak, at most by way of 2 (requests still finishing
    # inside the down window count as need), and never back up on the way.
    peak = max(i for i, r in enumerate(reasons) if re.match(r"scale \d+ -> 3\b", r))
    after = reasons[peak + 1 :]
    assert after and all(re.match(r"scale [32] -> [21]\b", r) for r in after), reasons
    assert re.match(r"scale [32] -> 1\b", after[-1]), reasons
    # Still served by the one left, through a routing table that caught up.
    assert await _outcome(_complete(oai, spec.name, 0)) == "200"
    await replicas.remove_deployment(client, spec, 60)


async def _listed_as(base: str, key: str, model: str, state: str) -> bool:
    return (await _models(base, key)).get(model) == state


async def test_idle_to_zero_then_twenty_requests_wake_one_replica(
    system: System, client: Client, tiny: TinyModel, oai_for: OpenAIFor
) -> None:
    policy = AutoscalePolicy(min_replicas=0, max_replicas=2, idle_timeout_s=2)
    spec = _spec(tiny, "tiny-router-wake", policy)
    key = system.catalog(spec)
    started = await system.start(client, "router-wake-node")
    await replicas.apply_deployment(client, spec, 1, timeouts=FAST)
    await wait_deployment(client, spec.name, lambda s: _ready(s) == 1)

    await wait_deployment(client, spec.name, lambda s: s.desired == 0 and not s.slots)
    # At zero, still listed, with its state, once the router's table caught up.
    await _until(lambda: _listed_as(started.base, key, spec.name, "scaled-to-zero"))
    await _until(lambda: _no_engine(spec.name))
    before = await _replica_workflows(client, spec.name)
    assert len(before) == 1

    oai = oai_for(started.base, key)
    outcomes = await asyncio.gather(*(_outcome(_complete(oai, spec.name, i)) for i in range(20)))
    assert outcomes == ["200"] * 20, outcomes

    status = await replicas.deployment_status(client, spec.name)
    assert [s.starts for s in status.slots] == [1]
    wakes = [d for d in status.decisions if d.reason.startswith("wake: ")]
    assert [(d.from_replicas, d.to_replicas) for d in wakes] == [(0, 1)], status.decisions
    assert len(pids_with_args("--alias", spec.name)) == 1

    async def listed_new() -> bool:
        return len(await _replica_workflows(client, spec.name)) > len(before)

    await _until(listed_new)  # visibility lags the start
    assert len(await _replica_workflows(client, spec.name) - before) == 1
    assert (await _models(started.base, key))[spec.name] == "ready"
    await replicas.remove_deployment(client, spec, 60)


async def _no_engine(model: str) -> bool:
    return not pids_with_args("--alias", model)


async def test_requests_waiting_on_a_wake_survive_the_control_worker_killed(
    system: System, client: Client, tiny: TinyModel, oai_for: OpenAIFor
) -> None:
    policy = AutoscalePolicy(min_replicas=0, max_replicas=2)
    spec = _spec(tiny, "tiny-router-kill", policy)
    key = system.catalog(spec)
    control = system.spawn("control")
    system.spawn("agent", {"LLMGW_NODE_ID": "router-kill-node"})
    port = free_port()
    system.start_router(port)
    base = f"http://127.0.0.1:{port}/v1"
    await replicas.wait_node_registered(client, "router-kill-node", 60)
    await replicas.apply_deployment(client, spec, 0, timeouts=FAST)
    await _until(lambda: _listed_as(base, key, spec.name, "scaled-to-zero"))

    oai = oai_for(base, key)
    calls = [asyncio.create_task(_outcome(_complete(oai, spec.name, i))) for i in range(3)]
    # The router's wake is in the history and a replica is on its way: kill -9.
    await wait_deployment(client, spec.name, lambda s: any(sl.replica_id for sl in s.slots))
    control.signal(signal.SIGKILL)
    control.proc.wait()
    assert not any(c.done() for c in calls)
    system.spawn("control")
    async with asyncio.timeout(240):
        outcomes = await asyncio.gather(*calls)
    assert outcomes == ["200"] * 3, outcomes
    status = await replicas.deployment_status(client, spec.name)
    assert [s.starts for s in status.slots] == [1]
    assert len(pids_with_args("--alias", spec.name)) == 1
    await replicas.remove_deployment(client, spec, 60)


async def test_a_failed_wake_answers_the_waiting_requests_why(
    system: System, client: Client, tiny: TinyModel, oai_for: OpenAIFor
) -> None:
    # Unplaceable: 8 GPUs on a CPU-only node.
    policy = AutoscalePolicy(min_replicas=0, max_replicas=1)
    no_room = _spec(tiny, "tiny-router-no-room", policy, gpus=8)
    # Listed as autoscaled, but its deployment ran with a fixed count and ended.
    ended = _spec(tiny, "tiny-router-ended", policy, gpus=8)
    key = system.catalog(no_room, ended)
    started = await system.start(client, "router-cpu-node")
    few = ReplicaTimeouts(place_retry_s=0.2, place_attempts=2)
    await replicas.apply_deployment(client, no_room, 0, timeouts=few)
    fixed = ended.model_copy(update={"autoscale": None})
    await replicas.apply_deployment(client, fixed, 1, timeouts=few)
    await replicas.apply_deployment(client, fixed, 0, timeouts=few)

    async def closed() -> bool:
        desc = await client.get_workflow_handle(deployment_workflow_id(ended.name)).describe()
        return desc.status != WorkflowExecutionStatus.RUNNING

    await _until(closed)
    await _until(lambda: _listed_as(started.base, key, no_room.name, "scaled-to-zero"))
    await _until(lambda: _listed_as(started.base, key, ended.name, "scaled-to-zero"))

    oai = oai_for(started.base, key)
    # One plain and one streamed request (a 200 with comments, then the error event).
    async with asyncio.timeout(QUEUE.max_wait_s):
        plain, streamed = await asyncio.gather(
            _outcome(_complete(oai, no_room.name, 0)), _outcome(_complete(oai, no_room.name, 1))
        )
    assert "Error code: 503" in plain, plain
    router_log = next(c for c in system.children if c.name == "router").log_path
    for answer in (plain, streamed):
        # The client gets an error id; why is in the router's log (and admin API).
        assert "could not be woken" in answer and "cannot place" not in answer, answer
        error_id = re.search(r"err_[0-9a-f]+", answer)
        assert error_id is not None, answer
        why = [ln for ln in router_log.read_text().splitlines() if error_id[0] in ln]
        assert why and "cannot place" in why[0] and "GPU" in why[0], why

    async with asyncio.timeout(QUEUE.max_wait_s):
        gone = await _outcome(_complete(oai, ended.name, 0))
    assert "Error code: 503" in gone, gone
    assert "could not be woken" in gone and "has no deployment" not in gone, gone
    error_id = re.search(r"err_[0-9a-f]+", gone)
    assert error_id is not None, gone
    why = [ln for ln in router_log.read_text().splitlines() if error_id[0] in ln]
    assert why and "has no deployment" in why[0], why
    await replicas.remove_deployment(client, no_room, 60)
