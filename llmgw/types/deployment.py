"""A model's deployment: desired replicas, restarts, rolling restarts."""

from pydantic import BaseModel, Field

from llmgw.types.elastic import AutoscalePolicy, ElasticState, LoadSummary, ScaleDecision
from llmgw.types.model import ModelSpec
from llmgw.types.replica import ReplicaTimeouts


class RestartPolicy(BaseModel):
    """How a deployment restarts replicas that fail."""

    initial_backoff_s: float = 2.0
    max_backoff_s: float = 300.0
    max_consecutive_failures: int = Field(default=5, ge=1)


class RollingRestartInput(BaseModel):
    """Update ``rolling_restart``: replace every replica, one at a time."""

    reason: str = "rolling restart"


class SetModelInput(BaseModel):
    """Update ``set_model``: the catalog entry changed; roll every replica onto it."""

    model: ModelSpec
    reason: str = "model changed in the catalog"


class ReplicaReadyNotice(BaseModel):
    """Signal from a replica to its deployment: it serves now."""

    replica_id: str
    node_id: str = Field(default="", description="the leader's node (asked for its load)")


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
    preempted_by: str = Field(default="", description="the replica its last one made room for")
    node_id: str = Field(default="", description="where its replica serves, once ready")


class DeploymentCarry(BaseModel):
    """What a deployment hands to its next run when its history gets long."""

    desired: int
    slots: list[Slot]
    next_slot: int
    rolling: list[int] = Field(default_factory=list)
    retiring: list[int] = Field(default_factory=list)
    live: list[int] = Field(
        default_factory=list, description="slots whose replica still runs; each reports its end"
    )
    elastic: ElasticState | None = Field(
        default=None, description="autoscaling state; None from runs before autoscaling"
    )


class DeploymentInput(BaseModel):
    """Input of a model's Deployment workflow (id ``deployment/<model>``)."""

    model: ModelSpec
    replicas: int = Field(default=1, ge=0)
    timeouts: ReplicaTimeouts = Field(default_factory=ReplicaTimeouts)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    continue_after_events: int = Field(
        default=0, ge=0, description="continue as new past this history length (0: when suggested)"
    )
    carry: "DeploymentCarry | None" = Field(
        default=None, description="state carried over by continue-as-new; None when first started"
    )


class DeploymentStatus(BaseModel):
    """A deployment's state: query result and update answer."""

    model: str
    desired: int
    slots: list[Slot] = Field(default_factory=list)
    rolling: list[int] = Field(default_factory=list, description="slots still to replace")
    model_digest: str = Field(default="", description="ModelSpec.digest() new replicas start from")
    autoscale: AutoscalePolicy | None = Field(
        default=None, description="the bounds it follows the load within; None: a fixed count"
    )
    decisions: list[ScaleDecision] = Field(
        default_factory=list, description="the last changes of the desired count, oldest first"
    )
    load: LoadSummary = Field(default_factory=LoadSummary, description="as the routers report it")
