"""The fleet: placement, the allocation ledger, liveness, cordons."""

from pydantic import BaseModel, Field

from llmgw.types.model import ModelSpec
from llmgw.types.node import NodeInventory


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
    priority: int = 0

    def shards(self) -> list[ShardPlacement]:
        """Every rank, leader first."""
        leader = ShardPlacement(rank=0, node_id=self.node_id, gpu_indices=self.gpu_indices)
        return [leader, *self.workers]


class PlaceRequest(BaseModel):
    """Ask the fleet for a node for a replica (idempotent per replica id)."""

    replica_id: str
    model: ModelSpec


class PlaceResult(BaseModel):
    """The fleet's answer: a placement, or every candidate's rejection.

    ``preempt``: no placement yet, but room is reserved for this replica once
    these lower-priority replicas have stopped; the caller asks them to.
    """

    placement: Placement | None = None
    rejections: list[Rejection] = Field(default_factory=list)
    preempt: list[str] = Field(default_factory=list)


class PlaceBatch(BaseModel):
    """Several placements in one fleet update, decided in order (one workflow
    task instead of one each: what lets the fleet place hundreds a second)."""

    requests: list[PlaceRequest]


class PlaceBatchResult(BaseModel):
    """One answer per request of a ``PlaceBatch``, in its order."""

    results: list[PlaceResult]


class NodesQuery(BaseModel):
    """Ask the fleet for some nodes' inventories (not the whole fleet's)."""

    node_ids: list[str]


class NodesResult(BaseModel):
    """The inventories of the nodes asked for that are registered."""

    nodes: dict[str, NodeInventory] = Field(default_factory=dict)


class Reservation(BaseModel):
    """Room promised to a preempting replica, held until its victims are gone."""

    placement: Placement
    victims: list[str]


class PreemptionRecord(BaseModel):
    """One replica drained to make room for a higher-priority one."""

    at: str
    preemptor: str
    preemptor_priority: int
    victim: str
    victim_priority: int
    node_id: str


class ReleaseRequest(BaseModel):
    """Give back a replica's allocation (a no-op when it holds none)."""

    replica_id: str
    node_lost: str = Field(
        default="",
        description="the node the replica found lost (its agent silent, its engine"
        " unreachable): offered to no replica until its agent registers again",
    )


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
    reservations: dict[str, Reservation] = Field(default_factory=dict)
    preemptions: list[PreemptionRecord] = Field(
        default_factory=list, description="the most recent preemptions, newest last"
    )
    # Agents re-register every 30 s by default; silence for this long means
    # the node is not offered to placement (its allocations stay recorded).
    stale_after_s: float = 120.0
    # A replica that failed on a lost node knew before the silence above
    # did: that node waits for its agent's next registration.
    lost: dict[str, str] = Field(
        default_factory=dict, description="node -> when a replica found it lost"
    )
