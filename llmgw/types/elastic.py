"""Elastic serving: autoscaling, scale to zero, the admission queue.

The contract between the routers (who see the load and hold waiting
requests) and a model's Deployment workflow (who decides the replica
count): routers send a :class:`LoadReport` per model at most once a second
(signal ``report_load``), and ask a deployment at zero replicas to wake
(update ``wake``, once per model however many requests wait). The
deployment records each scaling decision as a :class:`ScaleDecision`.
"""

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class Priority(StrEnum):
    """A key's priority class in the admission queue: served in this order."""

    HIGH = "high"
    NORMAL = "normal"
    BATCH = "batch"


class AutoscalePolicy(BaseModel):
    """How a model's replica count follows its load (catalog ``autoscale``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(default=0, ge=0, description="0 = scale to zero when idle")
    max_replicas: int = Field(default=4, ge=1)
    target_inflight: float = Field(
        default=4.0, gt=0, description="requests in flight (and waiting) per replica"
    )
    scale_up_window_s: float = Field(default=10.0, gt=0, description="averaged over to scale up")
    scale_down_window_s: float = Field(
        default=120.0, gt=0, description="stabilisation: the highest need over it is kept"
    )
    idle_timeout_s: float = Field(
        default=300.0, gt=0, description="no request for this long: 0 replicas (when min is 0)"
    )

    @field_validator("max_replicas")
    @classmethod
    def _bounds(cls, value: int, info: ValidationInfo) -> int:
        # On max_replicas, so that the error names the field (a catalog's
        # models[0].autoscale.max_replicas).
        low = info.data.get("min_replicas")
        if low is not None and value < low:
            raise ValueError(f"must not be below min_replicas ({low})")
        return value


class QueuePolicy(BaseModel):
    """A model's admission queue in each router (catalog ``queue``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_waiting: int = Field(
        default=256, ge=0, description="requests waiting per model, across keys (0: no queue)"
    )
    max_wait_s: float = Field(
        default=60.0, gt=0, description="a request waiting longer gets 503 with Retry-After"
    )
    key_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="the share of max_waiting one API key may hold (at least one request;"
        " 1: no per-key bound), so a flooding key leaves room for the others",
    )
    batch_headroom: int = Field(
        default=1,
        ge=0,
        description="slots of the model kept free for interactive requests: a batch-class"
        " request (a batch line) starts only when more are free, or when no interactive"
        " request of the model waits or runs",
    )
    batch_max_wait_s: float = Field(
        default=3600.0,
        gt=0,
        description="how long a batch-class request may wait (its caller retries past it);"
        " batch requests are not bound by max_wait_s nor key_share",
    )


class ModelLoad(BaseModel):
    """One router's load on one model over its last report interval."""

    model: str
    inflight: int = Field(default=0, ge=0, description="requests at an engine now")
    waiting: int = Field(default=0, ge=0, description="requests in the admission queue now")
    arrivals: int = Field(default=0, ge=0, description="requests that arrived in the interval")
    tokens: int = Field(default=0, ge=0, description="tokens accounted in the interval")
    interval_s: float = Field(default=1.0, gt=0)


class LoadReport(BaseModel):
    """Signal ``report_load`` to ``deployment/<model>``: a router's latest load.

    A router reports while the model has load and once more when it has
    none; the deployment forgets a router that has not reported for a while.
    """

    router_id: str = Field(min_length=1)
    load: ModelLoad


class WakeInput(BaseModel):
    """Update ``wake``: requests wait for a model scaled to zero."""

    router_id: str = ""
    reason: str = "a request arrived while scaled to zero"


class WakeResult(BaseModel):
    """The wake's outcome: a replica serves, or why none could start."""

    ready: bool
    reason: str = ""
    desired: int = 0


class SetAutoscaleInput(BaseModel):
    """Update ``set_autoscale``: follow load within these bounds (None: fixed count)."""

    policy: AutoscalePolicy | None = None


class ScaleDecision(BaseModel):
    """One change of a deployment's desired count, and why (``llmgw explain``)."""

    at: str = Field(description="ISO time of the decision (workflow time)")
    from_replicas: int
    to_replicas: int
    reason: str


class LoadSample(BaseModel):
    """One router's report as the deployment keeps it (workflow time, seconds)."""

    at: float = Field(description="workflow time of the report, seconds since the epoch")
    router_id: str
    inflight: int = 0
    waiting: int = 0
    arrivals: int = 0


class LoadSummary(BaseModel):
    """The load a deployment sees now, summed over the routers reporting."""

    inflight: int = 0
    waiting: int = 0
    routers: int = Field(default=0, description="routers whose last report has not expired")


class ElasticState(BaseModel):
    """A deployment's autoscaling state, carried through continue-as-new.

    The samples are carried too (bounded by the windows), so the down
    window's stabilisation does not restart with each new run.
    """

    policy: AutoscalePolicy | None = None
    decisions: list[ScaleDecision] = Field(default_factory=list)
    samples: list[LoadSample] = Field(default_factory=list)
    last_activity: float = Field(default=0.0, description="last request seen (0: never)")
    last_change: float = Field(default=0.0, description="last change of the desired count")
