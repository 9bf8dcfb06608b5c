"""Tracing: a replica start is one trace from the caller, through the control
worker, to the node agent (separate processes, real OTLP export)."""

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmgw import replicas
from llmgw.queues import replica_workflow_id
from llmgw.temporal import connect
from llmgw.tracing import Tracing, TracingSettings, build_provider, setup_tracing
from llmgw.types import ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

NODE = "trace-node"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    rx = OtlpReceiver()
    yield rx
    rx.close()


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {[(s.service, s.name) for s in spans]}"
    return found[0]


async def _activity_headers(client: Client, replica_id: str) -> list[set[str]]:
    handle = client.get_workflow_handle(replica_workflow_id(replica_id))
    return [
        set(e.activity_task_scheduled_event_attributes.header.fields)
        async for e in handle.fetch_history_events()
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


async def test_replica_start_is_one_trace_across_processes(
    system: System, client: Client, temporal_address: str, tiny: TinyModel, receiver: OtlpReceiver
) -> None:
    tracing_env = {
        "LLMGW_TRACING__EXPORTER": "otlp",
        "LLMGW_TRACING__ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export promptly
    }
    system.spawn("control", tracing_env)
    system.spawn_agent(NODE, tracing_env)
    await replicas.wait_node_registered(client, NODE, 60)
    provider = build_provider(
        TracingSettings(exporter="otlp", endpoint=receiver.endpoint), "test-caller"
    )
    assert provider is not None
    traced = await connect(temporal_address, interceptors=Tracing(provider).interceptors())
    spec = ModelSpec(name="tiny-traced", source=str(tiny.model_path))
    with provider.get_tracer("test").start_as_current_span("caller") as root:
        rid = await replicas.start_replica(traced, spec)
    trace_id = format(root.get_span_context().trace_id, "032x")
    await replicas.wait_ready(client, rid, 120)
    provider.force_flush()

    wanted = {
        ("llmgw-control", "RunWorkflow:Replica"),
        ("llmgw-control", "RunActivity:place_replica"),
        ("llmgw-control", "StartActivity:launch_shard"),
        ("llmgw-control", "replica.ready"),
        ("llmgw-agent", "RunActivity:fetch_weights"),
        ("llmgw-agent", "RunActivity:launch_shard"),
        ("llmgw-agent", "RunActivity:wait_shard_ready"),
    }
    async with asyncio.timeout(30):
        while not wanted <= {
            (s.service, s.name) for s in receiver.snapshot() if s.trace_id == trace_id
        }:
            await asyncio.sleep(0.1)
    spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]

    # The tree: caller -> StartWorkflow -> RunWorkflow -> StartActivity -> RunActivity (agent).
    start = _one(spans, "llmgw-test-caller", "StartWorkflow:Replica")
    assert start.parent_id == format(root.get_span_context().span_id, "016x")
    run = _one(spans, "llmgw-control", "RunWorkflow:Replica")
    assert run.parent_id == start.span_id
    schedule = _one(spans, "llmgw-control", "StartActivity:launch_shard")
    launch = _one(spans, "llmgw-agent", "RunActivity:launch_shard")
    assert launch.parent_id == schedule.span_id
    placed = _one(spans, "llmgw-control", "RunActivity:place_replica")
    assert placed.attributes["llmgw.node"] == NODE
    assert placed.attributes["llmgw.replica"] == rid

    # Context travels in the activities' headers when tracing is on ...
    assert all("_tracer-data" in h for h in await _activity_headers(client, rid))
    await replicas.stop_replica(client, rid, "test done", 60)
    provider.shutdown()


async def test_tracing_off_creates_nothing_and_carries_nothing(
    system: System, client: Client, tiny: TinyModel
) -> None:
    off = setup_tracing(TracingSettings(), "test")
    assert not off.enabled and off.interceptors() == []
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # still the no-op proxy

    system.spawn("control")
    system.spawn_agent("untraced-node")
    await replicas.wait_node_registered(client, "untraced-node", 60)
    rid = await replicas.start_replica(
        client, ModelSpec(name="tiny-untraced", source=str(tiny.model_path))
    )
    await replicas.wait_ready(client, rid, 120)
    headers = await _activity_headers(client, rid)
    assert headers and all(h == set() for h in headers), headers
    await replicas.stop_replica(client, rid, "test done", 60)
