"""What the start and wake benchmarks share: phase timestamps and their figures."""

import statistics
from datetime import datetime

from llmgw.types import ReplicaPhase


def phase_at(history: list[tuple[ReplicaPhase, str]], phase: ReplicaPhase) -> datetime:
    """When a replica entered ``phase``, by the workflow's clock."""
    return next(datetime.fromisoformat(at) for p, at in history if p is phase)


def percentile_ms(values: list[float], q: int) -> float:
    """The ``q``-th percentile of ``values`` (seconds), in milliseconds."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


def print_start_figures(title: str, totals: list[float], loads: list[float], what: str) -> None:
    """Start-to-ready, the engine's own load and the rest (``what``), p50 and p95."""
    overhead = [t - lo for t, lo in zip(totals, loads, strict=True)]
    print(title)
    for label, values in (("to ready", totals), ("engine's own load", loads), (what, overhead)):
        p50, p95 = percentile_ms(values, 50), percentile_ms(values, 95)
        print(f"  {label:24s} p50 {p50:7.0f} ms  p95 {p95:7.0f} ms")


def load_seconds(history: list[tuple[ReplicaPhase, str]]) -> float:
    """The engine's own load: from LOADING to READY."""
    return (
        phase_at(history, ReplicaPhase.READY) - phase_at(history, ReplicaPhase.LOADING)
    ).total_seconds()
