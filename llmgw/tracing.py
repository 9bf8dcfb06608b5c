"""Tracing: one OpenTelemetry setup for every llmgw process.

Each process's settings carry a ``tracing`` block (``LLMGW_TRACING__EXPORTER``
= ``otlp`` | ``console`` | ``none``, ``LLMGW_TRACING__ENDPOINT``,
``LLMGW_TRACING__SAMPLE_RATIO``, ``LLMGW_TRACING__SERVICE_NAME``). Off (the
default) creates no provider and no exporter, and installs no Temporal
interceptor, so nothing is carried in headers. On, Temporal's
``TracingInterceptor`` goes on the process's client (and so on its workers):
a replica start is one trace from the caller through the workflows to the
node activities in the agents' processes.
"""

from collections.abc import Sequence
from typing import Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from pydantic import BaseModel, Field
from temporalio.contrib.opentelemetry import TracingInterceptor


class TracingSettings(BaseModel):
    """The ``tracing`` block of a process's settings."""

    exporter: Literal["otlp", "console", "none"] = "none"
    endpoint: str = Field(
        default="http://127.0.0.1:4318/v1/traces", description="OTLP/HTTP traces endpoint"
    )
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    service_name: str = Field(default="", description="default: llmgw-<process>")


def build_provider(settings: TracingSettings, process: str) -> TracerProvider | None:
    """A tracer provider exporting as configured; None when tracing is off."""
    if settings.exporter == "none":
        return None
    exporter: SpanExporter
    if settings.exporter == "otlp":
        # Imported here: the exporter pulls in protobuf, which a process with
        # tracing off has no reason to load.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )

        exporter = OTLPSpanExporter(endpoint=settings.endpoint)
    else:
        exporter = ConsoleSpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name or f"llmgw-{process}"}),
        # A caller's decision to sample wins, so one trace is never half kept.
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class Tracing:
    """What a process got from its tracing settings."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded and context carried."""
        return self.provider is not None

    def interceptors(self) -> Sequence[TracingInterceptor]:
        """Temporal client and worker interceptors: none when off."""
        if self.provider is None:
            return []
        tracer = self.provider.get_tracer("llmgw.temporal")
        # Workflows started without a caller's span (from the temporal CLI,
        # a schedule) still get spans.
        return [TracingInterceptor(tracer, always_create_workflow_spans=True)]

    def shutdown(self) -> None:
        """Flush what is buffered (a process exiting would lose its last spans)."""
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(settings: TracingSettings, process: str) -> Tracing:
    """Configure this process's tracing; the provider becomes the global one."""
    provider = build_provider(settings, process)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return Tracing(provider)
