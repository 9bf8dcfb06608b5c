"""Catalog sources checked against what the agents report, when a catalog is applied.

An agent reads weights and adapters only from inside its weights roots
(``LLMGW_WEIGHTS_ROOTS``), only from local paths, and only what it can read.
Without this check a bad ``source`` is accepted by ``llmgw model apply`` and
fails at a replica's start: for an autoscaled model at its first wake, as a
503 to a client. Each agent reports its roots and what lies in them
(``NodeInventory.weights``); an entry is refused when no reporting node could
serve it, naming the field, and what a node cannot tell (a path deeper than
it lists) is not refused.

A remote source (``hf://``, ``s3://``, ``modelscope://``) is not on the nodes:
it is pinned instead (``pin_sources``): resolved to its commit, or its objects'
ETags and versions, or its files' sha256, and checked against its Hub or store.
"""

import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw.catalog import CatalogModel
from llmgw.errors import ConfigError
from llmgw.path_filter import OPAQUE, PathFilter
from llmgw.s3_pin import S3Store, pin_s3
from llmgw.sources import NOT_YET, HfSource, LocalSource, ModelScopeSource, S3Source, parse_source
from llmgw.storage_profiles import DEFAULT_PROFILE, profile_problem, s3_client
from llmgw.types import ModelSpec, NodeInventory, WeightsReport
from llmgw.types.weights_manifest import LATEST_OBJECTS

if TYPE_CHECKING:
    from llmgw.hub_pin import Hub
    from llmgw.modelscope_pin import ModelScope
    from llmgw.storage_profiles import StorageProfile
    from llmgw.types.weights_manifest import SourcePin

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
    """(path, "") for an absolute path or a file:// URL, else ("", why the agent
    refuses it): a remote source is pinned, not found on the nodes."""
    try:
        parsed = parse_source(source)
    except ConfigError as exc:
        return "", str(exc)
    if isinstance(parsed, LocalSource):
        return parsed.path, ""
    scheme = source.partition("://")[0]
    return "", f"{scheme}:// is not a local path on the nodes"


def remote_problem(source: str) -> str | None:
    """None for a local source; "" for a remote one llmgw pins; else
    why this remote source is refused (a scheme not served yet)."""
    try:
        parsed = parse_source(source)
    except ConfigError as exc:
        return str(exc)
    if isinstance(parsed, LocalSource):
        return None
    scheme = source.partition("://")[0]
    if scheme in NOT_YET:
        return f"{scheme}:// sources are not supported yet: {source!r}"
    return ""


def needs_nodes(entry: CatalogModel) -> bool:
    """Whether ``entry`` reads a local path that only the nodes can check."""
    return any(
        remote_problem(s) is None for s in (entry.source, *(a.source for a in entry.adapters))
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
    if not reports and any(needs_nodes(e) for e in entries):
        result.notes.append(
            "sources not checked against the nodes: no agent has reported its weights roots"
        )
    for i, entry in enumerate(entries):
        remote = remote_problem(entry.source)
        if remote:
            result.problems.append(f"{label(i)}source: {remote}")
        elif remote is None:
            _check_one(f"{label(i)}source", entry.source, reports, ages, result)
        for j, adapter in enumerate(entry.adapters):
            where = f"{label(i)}adapters[{j}].source"
            if remote_problem(adapter.source) is not None:
                # Adapters are read where the model runs; fetching them is later work.
                result.problems.append(f"{where}: adapters are read from local paths only")
            else:
                _check_one(where, adapter.source, reports, ages, result)
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


def pin_sources(
    entries: Sequence[CatalogModel],
    stored: Mapping[str, ModelSpec],
    hub: "Hub",
    refresh: bool = False,
    label: Callable[[int], str] = lambda i: f"models[{i}].",
    profiles: "Mapping[str, StorageProfile] | None" = None,
    modelscope: "ModelScope | None" = None,
) -> tuple[list[CatalogModel], list[str]]:
    """``entries`` with their remote sources pinned, and the
    problems, each naming its field (any: nothing is to be written). An entry
    keeps the pin it has, given in the file or stored under its name for the
    same source, engine, patterns and storage profile, unless ``refresh``: a
    replica started later gets the bytes the first one got. ``profiles``: the
    storage profiles s3:// sources are read with (LLMGW_STORAGE_PROFILES);
    ``modelscope``: where modelscope:// sources are pinned (None: modelscope.cn)."""
    pinner = _Pinner(hub, dict(profiles or {}), modelscope)
    pinned: list[CatalogModel] = []
    problems: list[str] = []
    for i, entry in enumerate(entries):
        try:
            pinned.append(pinner.pin(entry, stored.get(entry.name), refresh))
        except _Refused as exc:
            problems.append(f"{label(i)}{exc.field}: {exc}")
    return pinned, problems


class _Refused(ConfigError):
    def __init__(self, field: str, why: str) -> None:
        super().__init__(why)
        self.field = field


class _Pinner:
    """Pins one entry at a time; a store client is built once per profile."""

    def __init__(
        self, hub: "Hub", profiles: "dict[str, StorageProfile]", modelscope: "ModelScope | None"
    ) -> None:
        self.hub = hub
        self.modelscope = modelscope
        self.profiles = profiles
        self.stores: dict[str, S3Store] = {}

    def pin(self, entry: CatalogModel, stored: ModelSpec | None, refresh: bool) -> CatalogModel:
        try:
            parsed = parse_source(entry.source)
        except ConfigError as exc:
            raise _Refused("source", str(exc)) from None
        if not isinstance(parsed, _Remote):
            for name in ("include", "exclude", "pin"):
                if getattr(entry, name):
                    raise _Refused(name, "only for hf://, s3:// and modelscope:// sources")
        if not isinstance(parsed, S3Source) and entry.storage_profile is not None:
            raise _Refused("storage_profile", "only for s3:// sources")
        if not isinstance(parsed, _Remote):
            return entry
        scheme, asked = _asks(parsed)
        kept = entry.pin or _stored_pin(entry, stored)
        if kept is not None and (kept.repo != parsed.repo or kept.scheme != scheme):
            raise _Refused("pin", f"it pins {kept.repo}, not {parsed.repo}")
        if kept is not None and asked not in (kept.requested, kept.revision):
            raise _Refused(
                "pin",
                f"it pins {kept.requested!r}, the source asks {asked!r}"
                " (leave the pin out to resolve it)",
            )
        if kept is not None and not refresh:
            return entry.model_copy(update={"pin": kept})
        pin = self._resolve(entry, parsed)
        if kept is not None and kept.revision == pin.revision and kept.manifest == pin.manifest:
            pin = kept  # unchanged: the entry's digest stays, no restart
        return entry.model_copy(update={"pin": pin})

    def _resolve(self, entry: CatalogModel, parsed: "_Remote") -> "SourcePin":
        from llmgw.hub_pin import pin_hf  # noqa: PLC0415  (a slow import)
        from llmgw.modelscope_pin import ModelScope, pin_modelscope  # noqa: PLC0415

        try:
            if isinstance(parsed, HfSource):
                return pin_hf(parsed, entry.engine, entry.include, entry.exclude, self.hub)
            if isinstance(parsed, ModelScopeSource):
                where = self.modelscope or ModelScope()
                return pin_modelscope(parsed, entry.engine, entry.include, entry.exclude, where)
            store = self._store(entry.storage_profile)
            return pin_s3(parsed, entry.engine, entry.include, entry.exclude, store)
        except _Refused:
            raise
        except ConfigError as exc:
            raise _Refused("source", str(exc)) from None

    def _store(self, name: str | None) -> S3Store:
        wanted = name or DEFAULT_PROFILE
        if wanted in self.stores:
            return self.stores[wanted]
        problem = profile_problem(self.profiles, name)
        if problem:
            raise _Refused("storage_profile", problem)
        profile = self.profiles[wanted]
        try:
            secret = profile.secret()
        except OSError as exc:
            raise _Refused(
                "storage_profile",
                f"storage profile {wanted!r}: its secret_access_key_file cannot be read"
                f" ({exc.strerror})",
            ) from None
        store = S3Store(s3_client(profile, secret), profile.where(), wanted)
        self.stores[wanted] = store
        return store


_Remote = HfSource | S3Source | ModelScopeSource


def _asks(parsed: _Remote) -> tuple[str, str]:
    """The scheme a pin of ``parsed`` has, and the revision it asks for."""
    if isinstance(parsed, HfSource):
        from llmgw.hub_pin import DEFAULT_REVISION  # noqa: PLC0415  (a slow import)

        return "hf", parsed.revision or DEFAULT_REVISION
    if isinstance(parsed, ModelScopeSource):
        from llmgw.modelscope_pin import DEFAULT_REVISION as MS_DEFAULT  # noqa: PLC0415

        return "modelscope", parsed.revision or MS_DEFAULT
    return "s3", LATEST_OBJECTS


def _stored_pin(entry: CatalogModel, stored: ModelSpec | None) -> "SourcePin | None":
    """The stored entry's pin, when it pinned what ``entry`` asks for."""
    if stored is None or stored.pin is None:
        return None
    same = (stored.source, stored.engine, stored.include, stored.exclude,
            stored.storage_profile) == (
        entry.source, entry.engine, entry.include, entry.exclude, entry.storage_profile,
    )  # fmt: skip
    return stored.pin if same else None
