"""Decision spans from workflow code: what was decided, and why.

Temporal's tracing interceptor already gives every workflow, activity,
signal and update a span; these mark the decisions between them (a replica
preempting, a slot reaped, a restart scheduled). They are completed spans
(start = end), emitted only when not replaying, and nothing at all when the
worker runs without tracing.
"""

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from temporalio.contrib.opentelemetry import TracingWorkflowInboundInterceptor
    from temporalio.contrib.opentelemetry.workflow import completed_span

Attribute = str | int | float | bool


def decision(name: str, **attributes: Attribute) -> None:
    """Record ``name`` with ``attributes`` under the workflow's current span."""
    # Without the interceptor (tracing off) completed_span would fall back to
    # the global tracer with a deprecation warning: skip it instead.
    if TracingWorkflowInboundInterceptor._from_context() is None:
        return
    completed_span(name, attributes={f"llmgw.{k}": v for k, v in attributes.items()})


def count_scale(model: str, before: int, after: int) -> None:
    """Count a change of a deployment's desired replicas (``llmgw_scale_decisions``,
    exported when the control worker serves metrics). The workflow's meter
    counts nothing while replaying, so a decision is counted once."""
    direction = "up" if after > before else ("zero" if after == 0 else "down")
    workflow.metric_meter().create_counter(
        "llmgw_scale_decisions", "changes of a deployment's desired replicas"
    ).add(1, {"model": model, "direction": direction})


def count_fetched(model: str, bytes_by_source: dict[str, int]) -> None:
    """Count the weights bytes a node fetched for a replica, by where from
    (``llmgw_weights_fetched_bytes``, source ``origin`` or ``peer``): how
    often the origin is spared. Counted once, as ``count_scale``."""
    counter = workflow.metric_meter().create_counter(
        "llmgw_weights_fetched_bytes", "weights bytes fetched by nodes, by source", "By"
    )
    for source, moved in sorted(bytes_by_source.items()):
        kind = "origin" if source == "origin" else "peer"
        counter.add(moved, {"model": model, "source": kind})
