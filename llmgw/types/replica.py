"""A replica's lifecycle: phases, timeouts, status, multi-node start."""

from enum import StrEnum

from pydantic import BaseModel, Field

from llmgw.types.fleet import Placement
from llmgw.types.model import ModelSpec, Rendezvous
from llmgw.types.shard import ShardHandle


class ReplicaPhase(StrEnum):
    """A replica's lifecycle. Starting (process spawned) is distinct from
    Loading (weights loading): a big model legitimately loads for minutes."""

    PLACING = "placing"
    FETCHING = "fetching"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    # The node's agent is silent (frozen, dead, partitioned). That says
    # nothing about the engine: the replica stays routable while the engine
    # answers, and returns to ready when an agent adopts it again.
    NODE_LOST = "node-lost"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


TERMINAL_PHASES = frozenset({ReplicaPhase.STOPPED, ReplicaPhase.FAILED})
# Phases in which routers send a replica new requests.
ROUTABLE_PHASES = frozenset({ReplicaPhase.READY, ReplicaPhase.NODE_LOST})


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
    # Node lost (agent silent): the control plane probes the engine every
    # probe_interval_s and fails the replica (releasing its GPUs) only once
    # the engine itself has not answered for engine_unreachable_s.
    probe_interval_s: float = 5.0
    engine_unreachable_s: float = 60.0


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
    adapters: list[str] = Field(
        default_factory=list, description="LoRA adapters its engine holds (llama.cpp: in id order)"
    )
    preempted_by: str = Field(default="", description="the replica this one made room for")
    preempting: list[str] = Field(
        default_factory=list,
        description="lower-priority replicas drained to make room for this one",
    )


class ReplicaMemo(BaseModel):
    """What the router reads from a replica's memo: small and stable."""

    replica_id: str
    model: str
    phase: ReplicaPhase
    node_id: str = ""
    endpoint: str = ""
    engine: str = ""
    adapters: list[str] = Field(default_factory=list)


class StopReplicaInput(BaseModel):
    """Update ``stop``: drain (stop routing first) then stop the engine."""

    reason: str = "requested"
    drain: bool = True
    preempted_by: str = ""


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
