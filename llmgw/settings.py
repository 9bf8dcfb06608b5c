"""Settings: one class per process, read from ``LLMGW_*`` environment variables.

Each entry point builds its own settings object and passes it down; nothing
reads the environment anywhere else.
"""

import json
import os
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from llmgw.storage_profiles import StorageProfile, parse_profiles
from llmgw.tracing import TracingSettings

DEFAULT_WORK_DIR = Path(".llmgw")


def default_store_url(work_dir: Path) -> str:
    """The embedded default store: a SQLite file in the work dir."""
    return f"sqlite:///{work_dir.resolve() / 'llmgw.db'}"


class _Common(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LLMGW_", extra="ignore", env_nested_delimiter="__"
    )

    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    # Temporal in production (README "Temporal in production"): TLS is on
    # when set true or when any of the rest is set; false turns it off.
    temporal_tls: bool | None = None
    temporal_tls_ca: Path | None = None  # PEM of the CA that signed the server
    temporal_tls_cert: Path | None = None  # mTLS: client certificate (PEM)...
    temporal_tls_key: Path | None = None  # ...and its private key
    temporal_tls_server_name: str = ""  # when the address is not in the certificate
    temporal_api_key: SecretStr = SecretStr("")  # Temporal Cloud API key
    work_dir: Path = DEFAULT_WORK_DIR
    store_url: str = ""
    log_level: str = "INFO"
    # LLMGW_TRACING__EXPORTER=otlp|console|none, LLMGW_TRACING__ENDPOINT=...
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    # SIGTERM/SIGINT to exit, at most: a watchdog ends a shutdown still
    # waiting then (on a frozen Temporal server or database) with status 124.
    shutdown_timeout_s: float = 8.0
    # The most replicas a catalog entry or a scale call may ask of one model
    # (replicas, autoscale bounds): the catalog and the admin API refuse more,
    # naming this limit (llmgw/catalog.py).
    max_replicas_per_model: int = Field(default=64, ge=1)
    # hf:// sources (docs/guides/model-sources.md): the Hugging Face Hub or a
    # Hub-compatible mirror, and the token for gated or private repos, given
    # as LLMGW_HF_TOKEN or as a file holding it (LLMGW_HF_TOKEN_FILE, a
    # mounted secret), never on a command line.
    hf_endpoint: str = "https://huggingface.co"
    hf_token: SecretStr = SecretStr("")
    hf_token_file: Path | None = None
    # modelscope:// sources: ModelScope (or a mirror of its /api/v1/) and the
    # token for private repos, LLMGW_MODELSCOPE_TOKEN or _FILE, as for the Hub.
    modelscope_endpoint: str = "https://modelscope.cn"
    modelscope_token: SecretStr = SecretStr("")
    modelscope_token_file: Path | None = None
    # s3:// sources (docs/guides/model-sources.md): LLMGW_STORAGE_PROFILES,
    # JSON name -> {endpoint_url, region, access_key_id, secret_access_key or
    # secret_access_key_file, addressing_style}; an entry's storage_profile
    # names one, "default" when it names none (llmgw/storage_profiles.py).
    # Kept as the raw text, read by resolved_storage_profiles: a profile that
    # fails validation here would have its input, the secret, in the error.
    storage_profiles: SecretStr = SecretStr("")

    def resolved_store_url(self) -> str:
        """The store URL, defaulting to SQLite in the work dir."""
        return self.store_url or default_store_url(self.work_dir)

    def resolved_hf_token(self) -> str:
        """The Hub token ("": none): LLMGW_HF_TOKEN, else the file's first line."""
        if self.hf_token.get_secret_value():
            return self.hf_token.get_secret_value()
        if self.hf_token_file is not None:
            return self.hf_token_file.read_text().strip()
        return ""

    def resolved_modelscope_token(self) -> str:
        """The ModelScope token ("": none): LLMGW_MODELSCOPE_TOKEN, else the file's first line."""
        if self.modelscope_token.get_secret_value():
            return self.modelscope_token.get_secret_value()
        if self.modelscope_token_file is not None:
            return self.modelscope_token_file.read_text().strip()
        return ""

    def resolved_storage_profiles(self) -> dict[str, StorageProfile]:
        """LLMGW_STORAGE_PROFILES read, or a ConfigError that never shows a value."""
        return parse_profiles(self.storage_profiles.get_secret_value())


class ControlSettings(_Common):
    """The control-plane worker (task queue ``control``)."""

    # A SIGKILLed worker's sticky queue holds its workflows' next task until
    # this passes; the server default (10 s) stalls every in-flight start.
    sticky_schedule_to_start_s: float = 2.0
    # Running control activities (all short) get this to finish on SIGTERM;
    # it must leave room inside shutdown_timeout_s.
    graceful_shutdown_s: float = 5.0
    # Recovery passes (workflows/reconcile.py): 0 turns them off. Without the
    # catalog part only the ledger is audited.
    reconcile_interval_s: float = 30.0
    reconcile_catalog: bool = True
    # host:port to serve Prometheus metrics on (the Temporal SDK's and
    # llmgw_scale_decisions); empty serves none.
    metrics_address: str = ""
    # Durable jobs (batches, background responses) on the exec task queue:
    # the routers their activities send lines to (comma-separated base URLs;
    # the next one is tried on a connection error). `llmgw up` sets its own.
    router_urls: str = "http://127.0.0.1:8000"
    # Rows the routers inserted but whose workflow they could not start
    # (Temporal down, router killed) are started by the sweeper after this
    # long; 0 turns the sweeper off.
    job_sweep_interval_s: float = 5.0
    # Per batch: chunk activities running at once.
    batch_parallel_chunks: int = Field(default=4, ge=1)
    # Per chunk: lines in flight at once.
    batch_line_concurrency: int = Field(default=8, ge=1)
    # Lines per chunk activity.
    batch_chunk_lines: int = Field(default=100, ge=1)

    def router_url_list(self) -> list[str]:
        """``router_urls`` as a list, without trailing slashes."""
        return [u.strip().rstrip("/") for u in self.router_urls.split(",") if u.strip()]


class AgentSettings(_Common):
    """The node agent (task queue ``node-<node_id>``)."""

    node_id: str = Field(default_factory=socket.gethostname)
    # Where engines listen and where the router reaches them. Loopback is
    # right on one machine; a cluster sets the node's private address.
    engine_host: str = "127.0.0.1"
    # The address the node is managed through; its interface carries NCCL's
    # and Gloo's socket traffic. Defaults to engine_host.
    management_address: str = ""
    port_range_start: int = 18000
    port_range_end: int = 18999
    max_cpu_replicas: int = 4
    engine_threads: int = 0
    # KV cache of each vLLM CPU engine; 0 gives each a share of the node's memory.
    cpu_kv_cache_mib: int = 0
    graceful_shutdown_s: float = 5.0
    register_interval_s: float = 30.0
    engine_cache_dir: Path | None = None
    # When the agent is root, engines and their pass-throughs run as this
    # user, created by the agent when missing. Without a usable one (or with
    # an empty name) engines are refused, unless root engines are allowed.
    engine_user: str = "llmgw-engine"
    allow_root_engines: bool = False
    # When that user cannot reach the work dir (a clone under root's 0700
    # home), its home, the weights cache and the engine cache go to
    # <system_dir>/<digest of the work dir>/, made and owned by the agent
    # (worker_agent/system_dir.py system_place); the agent logs where. Empty: no
    # such directory, and such a work dir is refused (or root engines run).
    system_dir: Path | None = Path("/var/lib/llmgw")
    # Discovery sources; tests and demos point them at recorded snapshots.
    sys_root: Path = Path("/sys")
    gpu_snapshot: Path | None = None
    # The only directories catalog weights and LoRA adapters are read from,
    # symlinks resolved (worker_agent.weights.Roots): a JSON list or
    # os.pathsep-separated. Empty: <work_dir>/models (where `llmgw up` puts
    # its model).
    weights_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # Remote weights (worker_agent/fetch/): the most the cache's complete
    # artifacts may hold (0: no bound; least recently used ones no replica
    # uses are evicted), and how long no byte may arrive before a fetch
    # drops the connection and resumes.
    weights_cache_bytes: int = Field(default=0, ge=0)
    fetch_stall_s: float = Field(default=60.0, gt=0)
    # The peer server other agents fetch weights from (worker_agent/peering.py):
    # its port on the management address (0: a free one, advertised), off with
    # serve_peers false; peer_url: what others are told, when not
    # http://<management address>:<port> (a NAT, a proxy).
    serve_peers: bool = True
    peer_port: int = Field(default=0, ge=0, le=65535)
    peer_url: str = ""
    # Engine liveness (worker_agent/liveness.py; docs/guides/recovery.md): how
    # often a running engine is asked, through its work loop, whether it
    # still serves (0: never). A hung one is stopped and its replica replaced.
    liveness_interval_s: float = Field(default=10.0, ge=0)
    # The most one liveness ask waits for an answer.
    liveness_timeout_s: float = Field(default=10.0, gt=0)
    # Hung after this many unanswered asks in a row (0: rule off)...
    liveness_unanswered_rounds: int = Field(default=6, ge=0)
    # ...spanning at least this long: longer than one prompt batch takes on
    # the slowest device (llama.cpp answers between batches only; a 2,048-
    # token batch of a large model on CPUs can take minutes).
    liveness_unanswered_s: float = Field(default=300.0, ge=0)
    # Hung when it has requests in flight and its progress counter stood
    # still this long (0: rule off); longer than one prompt batch takes.
    liveness_stall_s: float = Field(default=600.0, ge=0)

    @field_validator("system_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("weights_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part for part in text.split(os.pathsep) if part]
        return value

    def resolved_engine_cache_dir(self) -> Path:
        """Where engine binaries are installed or built (cached per CPU)."""
        return self.engine_cache_dir or self.work_dir / "engines"

    def resolved_weights_roots(self) -> list[Path]:
        """Where weights and adapters may be read from, absolute."""
        return [p.resolve() for p in self.weights_roots or [self.work_dir / "models"]]


class RouterSettings(_Common):
    """The router (OpenAI API)."""

    host: str = "127.0.0.1"
    port: int = 8000
    refresh_interval_s: float = 1.0
    # Between full listings of the Replica workflows the routing table reads
    # only the replicas changed since (router/control_link/replica_source.py).
    full_resync_s: float = Field(default=300.0, gt=0)
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 600.0
    # An engine's host that stops acknowledging (a partition, a power loss)
    # sends no reset: its connections are given up after about this (TCP
    # keepalive and TCP_USER_TIMEOUT), and a request no byte of whose answer
    # came goes to another replica. 0: the kernel's defaults (hours).
    upstream_dead_peer_s: float = Field(default=10.0, ge=0)
    # Connections to engines, all replicas together; requests beyond wait.
    upstream_max_connections: int = 1024
    # The engine client: "raw" (router/forwarding/upstream_raw.py: asyncio protocol and
    # httptools, streams relayed from its read callback; about a third less
    # CPU per request) or "aiohttp" (router/forwarding/upstream.py).
    upstream_client: Literal["raw", "aiohttp"] = "raw"
    # While the event loop is busy, a stream's events after its first are
    # held up to this long and relayed together (router/forwarding/pacing.py): the
    # loop's CPU per event falls, and new requests are not served late.
    # 0: every engine read is relayed as it comes, however busy the loop.
    stream_coalesce_max_s: float = Field(default=0.05, ge=0, le=1.0)
    # Client connections (llmgw/listener.py): a request head must arrive
    # within header_timeout_s; an idle kept-alive connection is closed after
    # keepalive_timeout_s (longer than clients' own pools keep one, httpx's
    # and so the OpenAI SDK's 5 s, so the client retires it first); past
    # max_connections open, more are refused at accept. A request body must
    # be complete within body_timeout_s of its head (else 408); one client
    # address holds at most max_connections_per_client (0: no cap; behind a
    # proxy or load balancer that hides client addresses, raise it or use 0).
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)
    keepalive_timeout_s: int = Field(default=15, ge=1)
    max_connections: int = Field(default=4096, ge=1)
    max_connections_per_client: int = Field(default=1024, ge=0)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    # The admin API's credential (LLMGW_ADMIN_KEY); admin keys made with
    # ``llmgw keys create --admin`` work as well.
    admin_key: SecretStr = SecretStr("")
    # How long a key check is cached: the bound on a revocation reaching
    # other router processes.
    key_cache_ttl_s: float = 5.0
    # The longest a request waits for the store (a key lookup, a quota
    # reservation) before the store counts as down for it; then a key's last
    # answer serves for up to key_stale_s, and a quota key gets 503.
    store_wait_s: float = Field(default=2.0, gt=0)
    key_stale_s: float = Field(default=3600.0, ge=0)
    usage_flush_interval_s: float = 1.0
    # Where usage the store could not take yet is kept (router/billing/usage_spool.py;
    # default <work_dir>/router-usage): a router killed during a store outage
    # leaves it there for the next router started with the same directory.
    usage_spool_dir: Path | None = None
    max_request_bytes: int = 8 * 1024 * 1024
    # The largest file /v1/files takes (past it: 413 file_too_large, nothing
    # stored). Uploads stream into the store a chunk at a time, so this bounds
    # the store's use, not the router's memory; a large upload also needs
    # body_timeout_s long enough for it to arrive.
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1)
    # What one key's files may hold in all, its batches' results included
    # (past it an upload gets 413 file_storage_full, nothing stored; a
    # batch's results are always written). Expired files stop counting.
    max_key_file_bytes: int = Field(default=10 * 1024**3, ge=1)
    # What one stored response may hold: its request as stored (the whole
    # previous_response_id conversation included) and its input items (past
    # it: 400 response_too_large, nothing stored); and what one key's stored
    # responses may hold in all (past it: 400 response_storage_full).
    max_response_bytes: int = Field(default=16 * 1024**2, ge=1)
    max_key_response_bytes: int = Field(default=1024**3, ge=1)
    # Names this router in its load reports to the deployments (elastic
    # serving): unique among the routers of one system.
    router_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # Several routers in front of one llama.cpp model with routing.slots:
    # router slot_share (0 .. slot_shares-1) pins only the slots s with
    # s % slot_shares == slot_share, so no two routers pin one slot (llama.cpp
    # queues a request for a busy slot behind whatever holds it). One router: 0 of 1.
    # A router sends a replica at most its share's slots at once (the rest
    # wait in its queue): size routing.slots as slot_shares x that.
    slot_share: int = Field(default=0, ge=0)
    slot_shares: int = Field(default=1, ge=1)
    # Answers name the replica that served them (x-llmgw-replica): for tests,
    # benchmarks and debugging. Off by default: the name told a tenant whose
    # replica (and so whose cached prompts) its request reached.
    expose_replica_header: bool = False
    # uvicorn's line per request (LLMGW_ACCESS_LOG=true). Off by default: the
    # request span and /metrics say more, and the line costs a tenth of the
    # router's CPU per request.
    access_log: bool = False

    @model_validator(mode="after")
    def _share_in_shares(self) -> "RouterSettings":
        if self.slot_share >= self.slot_shares:
            raise ValueError(
                f"slot_share {self.slot_share} of slot_shares {self.slot_shares}:"
                " needs 0 <= slot_share < slot_shares"
            )
        return self

    def resolved_usage_spool_dir(self) -> Path:
        """Where this router's usage spool lives, absolute."""
        return (self.usage_spool_dir or self.work_dir / "router-usage").resolve()


class UpSettings(_Common):
    """``llmgw up``: the whole system on one machine."""

    temporal_port: int = 7233
    node_id: str = Field(default_factory=socket.gethostname)
    ui_port: int = 8233
    router_port: int = 8000
    port_range_start: int = 18000
    default_model: str = "tiny"
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    engine_cache_dir: Path | None = None

    def resolved_engine_cache_dir(self) -> Path:
        """Where engine binaries are installed or built (cached per CPU)."""
        return (self.engine_cache_dir or self.work_dir / "engines").resolve()
