"""What a field means on a reference page: its ``description=``, the comment
above it in the code, or, where the code says nothing, the table here.

Split from docs/gen_ref.py; used by the catalog, settings and Temporal pages.
"""

import inspect
from collections.abc import Callable

from pydantic.fields import FieldInfo

from refgen.common import PACKAGES

# Meanings of fields whose code gives none (no description, no comment): a
# description= on the field in the code supersedes the entry here.
_MEANING = {
    "CatalogFile.models": "the models of the catalog",
    "CatalogModel.engine": "the engine that serves the model",
    "CatalogModel.context_length": "the engine's context length (vLLM `--max-model-len`); "
    "also the token reservation of a request that sets no maximum",
    "CatalogModel.engine_args": "passed to the engine as given (e.g. llama.cpp "
    "`--embeddings --pooling mean`)",
    "CatalogModel.replicas": "desired replicas (a fixed count; `autoscale` overrides it)",
    "EngineProfile.max_lora_rank": "the largest adapter rank the engine accepts (vLLM)",
    "AdapterSpec.rank": "the adapter's LoRA rank",
    "AutoscalePolicy.max_replicas": "replicas at most",
    "_Common.temporal_address": "`host:port` of the Temporal frontend",
    "_Common.temporal_namespace": "namespace of every workflow, task queue and query; it must "
    "exist",
    "_Common.work_dir": "llmgw's files on this host: SQLite store, engines, weights, shard dirs",
    "_Common.store_url": "SQLAlchemy URL of the store (`postgresql://...` or `sqlite:///...`); "
    "empty: SQLite `llmgw.db` in the work dir",
    "_Common.log_level": "Python logging level",
    "TracingSettings.exporter": "`otlp`, `console`, or `none` (no provider, no interceptor)",
    "TracingSettings.sample_ratio": "share of traces sampled; a caller's decision wins",
    "ControlSettings.reconcile_catalog": "reconcile deployments against the catalog (off: only "
    "the ledger is audited)",
    "AgentSettings.node_id": "this node's id; its task queue is `node-<id>`",
    "AgentSettings.port_range_start": "first port the agent gives engines and pass-throughs",
    "AgentSettings.port_range_end": "last port the agent gives engines and pass-throughs",
    "AgentSettings.max_cpu_replicas": "CPU replicas this node takes at most (CPU slots)",
    "AgentSettings.engine_threads": "cores per CPU engine; 0: an equal share among "
    "max_cpu_replicas",
    "AgentSettings.graceful_shutdown_s": "running node activities get this to finish on SIGTERM",
    "AgentSettings.register_interval_s": "how often the agent re-registers with the fleet",
    "AgentSettings.engine_cache_dir": "where engines are installed or built; default "
    "`<work dir>/engines`",
    "AgentSettings.allow_root_engines": "let engines run as root when no engine user is usable",
    "AgentSettings.system_dir": "where the engine user's home and caches go when it cannot "
    "reach the work dir (a directory per work dir); empty: off",
    "AgentSettings.gpu_snapshot": "read GPUs from a recorded NVML snapshot (tests, demos)",
    "RouterSettings.host": "address the router listens on",
    "RouterSettings.port": "port the router listens on",
    "RouterSettings.refresh_interval_s": "how often the routing table is read from Temporal",
    "RouterSettings.upstream_connect_timeout_s": "connecting to an engine, at most",
    "RouterSettings.upstream_read_timeout_s": "waiting for an engine's next bytes, at most",
    "RouterSettings.keepalive_timeout_s": "an idle kept-alive client connection is closed after "
    "this",
    "RouterSettings.max_connections": "open client connections at most; more are reset at accept",
    "RouterSettings.max_header_bytes": "a request head over this gets 431",
    "RouterSettings.key_stale_s": "while the store is down, a key's last answer serves this long",
    "RouterSettings.usage_flush_interval_s": "usage and quota settlements are written in batches "
    "this often, and at shutdown",
    "RouterSettings.max_request_bytes": "a request body over this gets 413",
    "UpSettings.temporal_port": "port of the Temporal dev server `llmgw up` starts",
    "UpSettings.node_id": "the node id of the agent `llmgw up` starts",
    "UpSettings.ui_port": "port of the Temporal web UI",
    "UpSettings.router_port": "port of the router `llmgw up` starts",
    "UpSettings.port_range_start": "first of 1,000 engine ports",
    "UpSettings.default_model": "the model served once up",
    "UpSettings.ready_timeout_s": "waiting for the first completion, at most",
    "UpSettings.stop_timeout_s": "stopping everything on Ctrl-C, at most",
    "UpSettings.engine_cache_dir": "where engines are installed or built; default "
    "`<work dir>/engines`",
}


def _fallback(model: type, name: str) -> str:
    for cls in getattr(model, "__mro__", ()):
        text = _MEANING.get(f"{cls.__name__}.{name}")
        if text:
            return text
    return ""


def _comments(cls: type) -> dict[str, str]:
    """The comment above each field of a class (or after it on its line)."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            pending.append(text.lstrip("# "))
            continue
        name = text.split(":")[0].strip()
        if name.isidentifier() and ":" in text and not text.startswith(("def ", "@")):
            inline = text.split("  # ", 1)[1] if "  # " in text else ""
            out[name] = " ".join([*pending, inline]).strip()
        pending = []
    return out


def field_meaning(cls: type) -> Callable[[str, FieldInfo], str]:
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base.__module__.split(".")[0] in PACKAGES:
            comments.update(_comments(base))

    def meaning(name: str, field: FieldInfo) -> str:
        return field.description or comments.get(name) or _fallback(cls, name)

    return meaning
