"""Catalog sources checked against what the agents report, when a catalog is applied.

An agent reads weights and adapters only from inside its weights roots
(``LLMGW_WEIGHTS_ROOTS``), only from local paths, and only what it can read.
Without this check a bad ``source`` is accepted by ``llmgw model apply`` and
fails at a replica's start: for an autoscaled model at its first wake, as a
503 to a client. Each agent reports its roots and what lies in them
(``NodeInventory.weights``); an entry is refused when no reporting node could
serve it, naming the field, and what a node cannot tell (a path deeper than
it lists) is not refused.
"""

import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from llmgw.catalog import CatalogModel
from llmgw.path_filter import OPAQUE, PathFilter
from llmgw.types import NodeInventory, WeightsReport

ROOTS_SETTING = "LLMGW_WEIGHTS_ROOTS"

# What a node says of one path: fine, cannot tell, or why it would be refused.
OK = ""
UNKNOWN = None
MISSING = "does not exist"


@dataclass
class SourceCheck:
    """What the check found: ``problems`` refuse the apply, ``notes`` only inform."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def local_path(source: str) -> tuple[str, str]:
    """(path, "") for an absolute path or a file:// URL, else ("", why the agent refuses it)."""
    if source.startswith("/"):
        return posixpath.normpath(source), ""
    parts = urlsplit(source)
    if parts.scheme == "file":
        path = unquote(parts.path)
        if parts.netloc in ("", "localhost") and path.startswith("/"):
            return posixpath.normpath(path), ""
        return "", f"file URL {source!r} must name an absolute local path"
    if not parts.scheme:
        return "", f"{source!r} must be an absolute path on the nodes"
    return "", (
        f"remote sources are not supported (scheme {parts.scheme!r} in {source!r}): "
        "use an absolute local path or a file:// URL"
    )


def check_sources(
    entries: Sequence[CatalogModel],
    nodes: Mapping[str, NodeInventory],
    label: Callable[[int], str] = lambda i: f"models[{i}].",
    ages_s: Mapping[str, float] | None = None,
) -> SourceCheck:
    """Every entry's ``source`` and adapter ``source`` against the nodes' reports
    (``ages_s``: how old each node's report is, shown where a path is missing:
    a file added since shows at the node's next registration)."""
    result = SourceCheck()
    reports = {n: inv.weights for n, inv in sorted(nodes.items()) if inv.weights is not None}
    ages = ages_s or {}
    if not reports:
        result.notes.append(
            "sources not checked against the nodes: no agent has reported its weights roots"
        )
    for i, entry in enumerate(entries):
        fields = [(f"{label(i)}source", entry.source)]
        fields += [
            (f"{label(i)}adapters[{j}].source", a.source) for j, a in enumerate(entry.adapters)
        ]
        for where, source in fields:
            _check_one(where, source, reports, ages, result)
    return result


def _check_one(
    where: str,
    source: str,
    reports: Mapping[str, WeightsReport],
    ages: Mapping[str, float],
    result: SourceCheck,
) -> None:
    path, why = local_path(source)
    if why:
        result.problems.append(f"{where}: {why}")
        return
    if not reports:
        return
    verdicts = {node: verdict(report, path) for node, report in reports.items()}
    refused = {
        node: f"{v} (as reported {ages[node]:.0f}s ago)" if v == MISSING and node in ages else v
        for node, v in verdicts.items()
        if v
    }
    if not refused:
        return
    reasons = "; ".join(f"node {node}: {why}" for node, why in refused.items())
    if len(refused) == len(verdicts):
        result.problems.append(f"{where}: {path} cannot be read on any node ({reasons})")
    else:
        result.notes.append(f"{where}: {path} is not usable everywhere ({reasons})")


def verdict(report: WeightsReport, path: str) -> str | None:
    """Whether a node could serve ``path`` (normalised, absolute): OK, UNKNOWN,
    or the reason it would refuse it."""
    root = next((r for r in report.roots if path == r or path.startswith(r.rstrip("/") + "/")), "")
    if not root:
        roots = ", ".join(report.roots) or "none"
        return f"outside the weights roots ({roots}; {ROOTS_SETTING} lists them)"
    if path == root:
        return OK
    ancestors = []  # nearest first, the root left out
    parent = posixpath.dirname(path)
    while parent not in (root, "/"):
        ancestors.append(parent)
        parent = posixpath.dirname(parent)
    refused = {e.path: e.problem for e in report.refused}
    if path in refused:
        return refused[path]
    for above in ancestors:
        if above in refused:
            return f"{above} {refused[above]}"
    if not report.found_bits:
        return UNKNOWN
    found = PathFilter.decode(report.found, report.found_bits)
    if path in found:
        return OK
    if any(OPAQUE + above in found for above in ancestors):
        return UNKNOWN  # under a link or deeper than the node walks
    return MISSING if report.complete else UNKNOWN
