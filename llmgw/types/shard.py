"""One shard on one node: the node activities' inputs and results."""

from pydantic import BaseModel, Field

from llmgw.types.model import EngineKind, ModelSpec, Rendezvous
from llmgw.types.node import ShardRef
from llmgw.types.weights_manifest import SourcePin


class ShardSpec(BaseModel):
    """Everything an agent needs to start one shard of a replica."""

    replica_id: str
    rank: int = 0
    model: ModelSpec
    gpu_indices: list[int] = Field(default_factory=list)
    rendezvous: Rendezvous | None = None
    port: int | None = Field(default=None, description="a port reserved for this shard")
    catalog_digest: str = Field(
        default="", description="ModelSpec.digest() of the catalog entry, before any rewrite"
    )


class LaunchShardInput(BaseModel):
    """Input of ``launch_shard``."""

    spec: ShardSpec


class PortReservation(BaseModel):
    """A port an agent set aside for a shard that peers must find."""

    host: str
    port: int


class ShardHandle(BaseModel):
    """A running shard: result of ``launch_shard``."""

    replica_id: str
    rank: int
    pid: int
    port: int
    endpoint: str
    already_running: bool = Field(
        default=False, description="true when a repeated launch found the engine running"
    )


class FetchWeightsInput(BaseModel):
    """Input of ``fetch_weights``: bring a model's weights into the node's cache."""

    replica_id: str
    source: str
    sha256: str | None = None
    # The engine to install (once, cached) before the weights: both are what the
    # node needs before a start, and only this step has an hours-long bound.
    engine: EngineKind | None = None
    device: str = "cuda"
    # A remote source's pin (model apply): the files fetched, at that revision.
    pin: SourcePin | None = None
    # s3:// sources: the node's storage profile to read it with (None: "default").
    storage_profile: str | None = None
    # Whose nodes may hold the weights already (worker_agent/peering.py): the
    # model's name, or the nodes to ask first (empty: found from the fleet).
    model: str = ""
    peer_nodes: list[str] = Field(default_factory=list)
    # Record the replica as a user of the cached artifact until it stops (so
    # the cache budget never evicts it); a pull ahead of a deploy holds none.
    hold: bool = True


GIB = 2**30
MIB = 2**20


class FetchProgressDetail(BaseModel):
    """A remote fetch's heartbeat details: what the Temporal UI shows on the
    activity and ``llmgw status``/``explain`` on the replica."""

    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    rate_bps: float
    source: str = Field(description='"origin", or the node id of the peer bytes come from')

    def text(self) -> str:
        """``fetching 3.2 / 15.0 GiB at 210 MiB/s from node-2``."""
        unit, size = ("GiB", GIB) if self.bytes_total >= GIB else ("MiB", MIB)
        return (
            f"fetching {self.bytes_done / size:.1f} / {self.bytes_total / size:.1f} {unit}"
            f" at {self.rate_bps / MIB:.0f} MiB/s from {self.source}"
            f" ({self.files_done}/{self.files_total} files)"
        )


class FetchWeightsResult(BaseModel):
    """Where the weights are on the node, verified."""

    path: str
    sha256: str
    size_bytes: int
    cached: bool
    # Bytes moved by this fetch, by where from ("origin" or a peer's node id).
    bytes_by_source: dict[str, int] = Field(default_factory=dict)


class WaitReadyInput(BaseModel):
    """Input of ``wait_shard_ready``."""

    shard: ShardRef
    timeout_s: float = 600.0
    # Every poll the engine is ready but not yet probed is start-to-ready
    # lost (half a poll on average); a /health probe is cheap, even to an
    # engine busy loading (tests/bench/bench_control.py).
    poll_interval_s: float = 0.05


class WaitReadyResult(BaseModel):
    """The engine answered ``/health`` and listed its model."""

    model_ids: list[str]


class WatchShardInput(BaseModel):
    """Input of ``watch_shard``: returns only when the shard exits."""

    shard: ShardRef
    poll_interval_s: float = 1.0


class ShardExit(BaseModel):
    """How a shard ended."""

    exit_code: int | None
    reason: str
    log_tail: list[str] = Field(default_factory=list)
    node_lost: str = Field(
        default="", description="the node, when it ended because the node was lost"
    )


class ShardRunning(BaseModel):
    """Result of ``shard_running``: the engine process the agent finds for a shard."""

    pid: int | None = Field(description="the leader's pid; None when it is not running")
    exit: ShardExit | None = Field(default=None, description="how it ended, when it has")


class ProbeEngineInput(BaseModel):
    """Input of ``probe_engine``: watch an engine from outside its node."""

    replica_id: str
    endpoint: str
    interval_s: float = 5.0
    unreachable_s: float = 60.0


class ProbeEngineResult(BaseModel):
    """The engine stopped answering for ``unreachable_s``: what was seen last."""

    last_error: str
    unanswered_s: float


class DrainInput(BaseModel):
    """Input of ``drain_shard``: wait until the engine has nothing in flight."""

    shard: ShardRef
    timeout_s: float = 60.0
    poll_interval_s: float = 0.25


class DrainResult(BaseModel):
    """Whether the engine went idle before the deadline."""

    idle: bool
    waited_s: float
    detail: str = ""


class ShardLoad(BaseModel):
    """Result of ``shard_load``: requests in flight on the engine right now."""

    in_flight: float | None = Field(default=None, description="None: the engine cannot say")
    detail: str = ""


class StopShardInput(BaseModel):
    """Input of ``stop_shard``: no-op on a stopped shard."""

    shard: ShardRef
    grace_s: float = 10.0


class StopShardResult(BaseModel):
    """Result of ``stop_shard``."""

    was_running: bool
    exit_code: int | None = None


class LogTailInput(BaseModel):
    """Input of ``shard_log_tail``."""

    shard: ShardRef
    lines: int = Field(default=100, ge=1, le=2000)


class LogTail(BaseModel):
    """The last lines a shard's engine wrote."""

    lines: list[str]


class ShardLogsInput(BaseModel):
    """Input of the ``ShardLogs`` workflow: fetch a tail from a node."""

    node_id: str
    shard: ShardRef
    lines: int = Field(default=100, ge=1, le=2000)
