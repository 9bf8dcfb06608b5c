"""Load reports and wakes as the router sends them: which loads go out (a pure
function), and the Temporal link against a real Temporal dev server, where a
small recording workflow registered as ``Deployment`` stands in for the
control plane's (it records ``report_load`` and answers ``wake``)."""

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from llmgw import contracts
from llmgw.queues import deployment_workflow_id
from llmgw.types import AutoscalePolicy, LoadReport, ModelLoad, WakeInput, WakeResult
from router.control_link.deployment_link import TemporalDeploymentLink
from router.control_link.load_report import LoadCounter, LoadReporter, loads
from router.control_link.routing import RoutingTable
from tests.gateway_util import ready, spec

M = "m1"


def table(*autoscaled: str, fixed: tuple[str, ...] = ()) -> RoutingTable:
    t = RoutingTable()
    catalog = {m: spec(m).model_copy(update={"autoscale": AutoscalePolicy()}) for m in autoscaled}
    catalog |= {m: spec(m) for m in fixed}
    t.update([ready(f"r-{m}", m, f"http://{m}:1") for m in (*autoscaled, *fixed)], catalog)
    return t


def test_a_report_while_there_is_load_then_one_zero_then_none() -> None:
    t = table(M, fixed=("fixed",))
    reported: set[str] = set()

    def round_(inflight: int = 0, waiting: int = 0, arrivals: int = 0) -> list[ModelLoad]:
        t.routes[M][0].inflight = inflight
        t.routes["fixed"][0].inflight = 5  # never reported: no autoscale
        return loads(
            t, lambda m: waiting if m == M else 0, {M: arrivals, "fixed": 9}, {}, reported, 1.0
        )

    assert round_() == []  # idle from the start: nothing to say
    [busy] = round_(inflight=2, arrivals=3)
    assert (busy.model, busy.inflight, busy.arrivals) == (M, 2, 3)
    [waiting] = round_(waiting=4)
    assert (waiting.inflight, waiting.waiting) == (0, 4)
    [zero] = round_()
    assert (zero.inflight, zero.waiting, zero.arrivals, zero.tokens) == (0, 0, 0, 0)
    assert round_() == [] and round_() == []


def test_the_counter_restarts_at_each_take() -> None:
    counter = LoadCounter()
    counter.arrived(M)
    counter.arrived(M)
    counter.served(M, 10)
    counter.served(M, 0)
    assert counter.take() == ({M: 2}, {M: 10})
    assert counter.take() == ({}, {})


class _Failing:
    async def report(self, model: str, report: LoadReport) -> None:
        raise RuntimeError("Temporal is down")

    async def wake(self, model: str, wake: WakeInput) -> WakeResult:
        raise RuntimeError("Temporal is down")


async def test_a_failed_report_is_dropped() -> None:
    counter = LoadCounter()
    counter.arrived(M)
    reporter = LoadReporter(table(M), counter, lambda m: 0, _Failing(), "r")
    await reporter.report_once(1.0)  # logs, does not raise
    assert counter.take() == ({}, {})


# This module imports the router (aiohttp...): the sandbox would re-import it all.
@workflow.defn(name=contracts.DEPLOYMENT.name, sandboxed=False)
class RecordingDeployment:
    """Records load reports; answers a wake once told whether a replica came up."""

    def __init__(self) -> None:
        self.reports: list[LoadReport] = []
        self.wakes: list[WakeInput] = []
        self.outcome: WakeResult | None = None

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name=contracts.REPORT_LOAD.name)
    def report_load(self, report: LoadReport) -> None:
        self.reports.append(report)

    @workflow.update(name=contracts.WAKE.name)
    async def wake(self, wake: WakeInput) -> WakeResult:
        self.wakes.append(wake)
        await workflow.wait_condition(lambda: self.outcome is not None)
        assert self.outcome is not None
        return self.outcome

    @workflow.signal
    def answer(self, outcome: WakeResult) -> None:
        self.outcome = outcome

    @workflow.query
    def seen(self) -> tuple[list[LoadReport], list[WakeInput]]:
        return self.reports, self.wakes


@pytest.fixture
async def deployment(client: Client) -> AsyncIterator[tuple[str, WorkflowHandle[object, None]]]:
    model = f"elastic-{uuid.uuid4().hex[:8]}"
    queue = f"deploy-{model}"
    async with Worker(client, task_queue=queue, workflows=[RecordingDeployment]):
        handle = await client.start_workflow(
            contracts.DEPLOYMENT.name, id=deployment_workflow_id(model), task_queue=queue
        )
        yield model, handle
        await handle.terminate("test over")


async def test_reports_and_a_wake_reach_the_deployment_workflow(
    client: Client, deployment: tuple[str, WorkflowHandle[object, None]]
) -> None:
    model, handle = deployment
    link = TemporalDeploymentLink(client)
    load = ModelLoad(model=model, inflight=3, waiting=2, arrivals=7, tokens=90)
    await link.report(model, LoadReport(router_id="router-a", load=load))
    wake = asyncio.create_task(link.wake(model, WakeInput(router_id="router-a")))
    async with asyncio.timeout(20):
        while True:
            reports, wakes = await handle.query(
                "seen", result_type=tuple[list[LoadReport], list[WakeInput]]
            )
            if reports and wakes:
                break
            await asyncio.sleep(0.05)
    assert reports == [LoadReport(router_id="router-a", load=load)]
    assert [w.router_id for w in wakes] == ["router-a"]
    assert not wake.done()  # the update waits for a replica
    await handle.signal("answer", WakeResult(ready=True, desired=1))
    async with asyncio.timeout(20):
        assert await wake == WakeResult(ready=True, desired=1)


async def test_a_failed_wake_comes_back_with_its_reason(
    client: Client, deployment: tuple[str, WorkflowHandle[object, None]]
) -> None:
    model, handle = deployment
    link = TemporalDeploymentLink(client)
    await handle.signal("answer", WakeResult(ready=False, reason="no node fits 2 GPUs"))
    async with asyncio.timeout(20):
        result = await link.wake(model, WakeInput(router_id="r"))
    assert result == WakeResult(ready=False, reason="no node fits 2 GPUs")


async def test_a_model_without_a_deployment_cannot_be_woken(client: Client) -> None:
    link = TemporalDeploymentLink(client, rpc_timeout=timedelta(seconds=5))
    async with asyncio.timeout(20):
        result = await link.wake(f"nothing-{uuid.uuid4().hex[:8]}", WakeInput())
    assert not result.ready and "has no deployment" in result.reason
