"""The metrics page (reference/metrics.md): every Prometheus metric and
Temporal meter declared in the source.
"""

import ast
from pathlib import Path

from refgen.common import ROOT, cell, sources

_PROMETHEUS = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "GaugeMetricFamily": "gauge",
    "CounterMetricFamily": "counter",
}
_METER = {"create_counter": "counter", "create_gauge": "gauge", "create_histogram": "histogram"}


def _literal_list(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.List | ast.Tuple):
        return [
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        ]
    return []


def _metric_row(node: ast.Call, path: Path) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    kind = _PROMETHEUS.get(name) or _METER.get(name)
    if kind is None or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    metric = str(node.args[0].value)
    doc = (
        node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
    )
    labels = _literal_list(node.args[2] if len(node.args) > 2 else None)
    labels += [
        x
        for k in node.keywords
        if k.arg in ("labels", "labelnames")
        for x in _literal_list(k.value)
    ]
    where = path.relative_to(ROOT)
    if name in _METER:
        exposed, process = metric, "control worker (Temporal meter, at `LLMGW_METRICS_ADDRESS`)"
    else:
        exposed = f"{metric}_total" if kind == "counter" else metric
        process = "router (`GET /metrics`)" if where.parts[0] == "router" else str(where.parts[0])
    label_text = ", ".join(f"`{x}`" for x in labels)
    return (
        f"| `{exposed}` | {kind} | {label_text} | {cell(doc)} | {process} "
        f"| `{where}:{node.lineno}` |"
    )


def metrics_page() -> str:
    rows = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                row = _metric_row(node, path)
                if row:
                    rows.append(row)
    return (
        "# Metrics\n\n"
        "Every metric llmgw declares, found in the source (Prometheus metrics of "
        "`prometheus_client`, and the control worker's Temporal meter). A counter is "
        "exposed with the `_total` suffix; a histogram as `_bucket`, `_sum` and `_count`. "
        "The router's `GET /metrics` answers the admin credential only (a bearer token). "
        "Engines' own metrics are relayed by "
        "`GET /admin/engines/metrics` ([Tracing and metrics](../guides/tracing-metrics.md)).\n\n"
        "| metric | type | labels | meaning | served by | declared |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(sorted(rows)) + "\n"
    )
