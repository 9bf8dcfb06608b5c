"""The ``--json`` shapes of the CLI's listings, in one place.

Operators script these (docs/reference/cli-json.md), so each is its own
model rather than a dump of an internal type: a field of ``DeploymentStatus``
or ``KeyInfo`` may change without changing what ``llmgw status --json``
prints. Fields are only ever added. Every command prints one JSON object
(never a bare list, so that a field can be added at the top level too).

Catalog entries are the exception: ``llmgw model list/show --json`` print
``CatalogModel`` as ``llmgw model apply`` reads it and ``GET /admin/models``
answers it, a format documented field by field in reference/catalog.md.
"""

import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from llmgw.catalog import CatalogModel
from llmgw.types import DeploymentStatus, ReplicaMemo, ScaleDecision

if TYPE_CHECKING:
    from llmgw.store.openai_tables import BatchRecord
    from router.api.apikeys import KeyInfo


class ReplicaRow(BaseModel):
    """One replica, as ``llmgw status`` lists it."""

    replica_id: str
    model: str
    phase: str = Field(description="placing, fetching, starting, loading, ready, node-lost, ...")
    node_id: str = Field(description="the leader's node; empty until placed")
    endpoint: str = Field(description="the engine's address; empty until it serves")
    progress: list[str] = Field(
        default_factory=list,
        description='while fetching: "fetching 3.2 / 15.0 GiB at 210 MiB/s from node-2"',
    )

    @classmethod
    def of(cls, memo: ReplicaMemo, progress: list[str] | None = None) -> "ReplicaRow":
        """The row of a replica's memo (and its weights fetches' progress)."""
        return cls(
            replica_id=memo.replica_id,
            model=memo.model,
            phase=memo.phase.value,
            node_id=memo.node_id,
            endpoint=memo.endpoint,
            progress=progress or [],
        )


class AutoscaleBounds(BaseModel):
    """The bounds an autoscaled deployment follows its load within."""

    min_replicas: int
    max_replicas: int
    target_inflight: float = Field(description="requests in flight (and waiting) per replica")


class SlotRow(BaseModel):
    """One desired replica of a deployment, across its restarts."""

    slot: int
    replica_id: str = Field(description="its current replica; empty between starts")
    ready: bool
    starts: int
    failures: int = Field(description="consecutive failed starts")
    reaped: bool
    last_reason: str


class DeploymentRow(BaseModel):
    """One model's deployment, as ``llmgw status`` and ``llmgw scale`` show it."""

    model: str
    desired: int
    ready: int = Field(description="slots whose replica serves")
    inflight: int = Field(description="requests at an engine, as the routers report")
    waiting: int = Field(description="requests in the routers' admission queues")
    autoscale: AutoscaleBounds | None = Field(description="null: a fixed count")
    slots: list[SlotRow]

    @classmethod
    def of(cls, status: DeploymentStatus) -> "DeploymentRow":
        """The row of a deployment's status query."""
        policy = status.autoscale
        return cls(
            model=status.model,
            desired=status.desired,
            ready=sum(s.ready for s in status.slots),
            inflight=status.load.inflight,
            waiting=status.load.waiting,
            autoscale=None
            if policy is None
            else AutoscaleBounds(
                min_replicas=policy.min_replicas,
                max_replicas=policy.max_replicas,
                target_inflight=policy.target_inflight,
            ),
            slots=[
                SlotRow(
                    slot=s.slot,
                    replica_id=s.replica_id,
                    ready=s.ready,
                    starts=s.starts,
                    failures=s.consecutive_failures,
                    reaped=s.reaped,
                    last_reason=s.last_reason,
                )
                for s in status.slots
            ],
        )


class NodeRow(BaseModel):
    """One registered node, as ``llmgw status`` lists it."""

    node_id: str
    hostname: str
    address: str = Field(description="where the routers reach its engines")
    peer_url: str = Field(description="its weights peer server, for other agents; empty: none")
    state: str = Field(description='"up", or why placement leaves it out: cordoned, silent, ...')


class StatusOutput(BaseModel):
    """``llmgw status --json``."""

    replicas: list[ReplicaRow]
    deployments: list[DeploymentRow] = Field(description="by model name")
    nodes: list[NodeRow] = Field(
        default_factory=list, description="by node id; empty when the fleet does not answer"
    )


class NodeReason(BaseModel):
    """Why a node was left out of a placement ("*": no node at all)."""

    node_id: str
    reason: str


class ShardRow(BaseModel):
    """Where one rank of a replica would go."""

    rank: int
    node_id: str


class SharedNode(BaseModel):
    """Replicas of the model on one node, though losing it then takes them all."""

    node_id: str
    replicas: list[str] = Field(description="the placed replicas there, by id")
    new_replica: bool = Field(description="a new replica would go there too")
    reason: str = Field(description="why no other node took one of them")

    def line(self, model: str) -> str:
        """The sentence ``llmgw explain`` prints for it."""
        *most, last = self.replicas
        placed = f"{', '.join(most)} and {last}" if most else last
        if self.new_replica:
            return f"{model}: a new replica would share node {self.node_id} with {placed}: " + (
                self.reason
            )
        return f"{model}: replicas {placed} share node {self.node_id}: {self.reason}"


class Preemption(BaseModel):
    """No free room, but draining lower-priority replicas would make some."""

    priority: int = Field(description="the model's priority")
    victims: list[str] = Field(description="replica ids that would be drained")
    nodes: list[str] = Field(description="the nodes they free room on")


class DecisionRow(BaseModel):
    """One change of a deployment's desired count, and why."""

    at: str = Field(description="ISO time (workflow time)")
    from_replicas: int
    to_replicas: int
    reason: str

    @classmethod
    def of(cls, decision: ScaleDecision) -> "DecisionRow":
        """The row of a recorded decision."""
        return cls(
            at=decision.at,
            from_replicas=decision.from_replicas,
            to_replicas=decision.to_replicas,
            reason=decision.reason,
        )


class ExplainDeployment(BaseModel):
    """The model's deployment, as ``llmgw explain`` reports it."""

    desired: int
    autoscale: AutoscaleBounds | None = Field(description="null: a fixed count")
    inflight: int
    waiting: int
    routers: int = Field(description="routers whose last load report has not expired")
    decisions: list[DecisionRow] = Field(description="the last ones, oldest first")

    @classmethod
    def of(cls, status: DeploymentStatus) -> "ExplainDeployment":
        """The scaling side of a deployment's status query."""
        return cls(
            desired=status.desired,
            autoscale=DeploymentRow.of(status).autoscale,
            inflight=status.load.inflight,
            waiting=status.load.waiting,
            routers=status.load.routers,
            decisions=[DecisionRow.of(d) for d in status.decisions],
        )


class ExplainOutput(BaseModel):
    """``llmgw explain MODEL --json``: at most one of ``placement`` and
    ``preemption`` is set; neither means no placement."""

    model: str
    placement: list[ShardRow] | None = Field(description="where a new replica would go")
    preemption: Preemption | None
    rejections: list[NodeReason] = Field(description="nodes left out, and why")
    shared: list[SharedNode] = Field(
        default_factory=list,
        description="nodes holding more than one of the model's replicas (a new one included)",
    )
    deployment: ExplainDeployment | None = Field(description="null: no deployment running")
    fetching: list[ReplicaRow] = Field(
        default_factory=list, description="the model's replicas fetching weights, with progress"
    )


class KeyRow(BaseModel):
    """One client API key: its id, prefix and policy, never the key itself."""

    id: int
    name: str
    prefix: str = Field(description="the key's first characters, as shown at creation")
    created_at: datetime
    state: str = Field(description="active, admin or revoked")
    models: list[str] = Field(description="the models it may use; empty: all")
    expires_at: datetime | None = Field(description="null: never")
    rpm: int = Field(description="requests per minute; 0: no limit")
    tpm: int = Field(description="tokens per minute; 0: no limit")
    token_budget: int = Field(description="tokens per budget period; 0: no limit")
    budget_period: str = Field(description="day or month")
    weight: float
    priority: str = Field(description="admission queue class: high, normal or batch")

    @classmethod
    def of(cls, info: "KeyInfo") -> "KeyRow":
        """The row of a stored key (which holds only the key's hash anyway)."""
        p = info.policy
        return cls(
            id=info.id, name=info.name, prefix=info.prefix, created_at=info.created_at,
            state="revoked" if info.revoked else ("admin" if p.admin else "active"),
            models=p.models, expires_at=p.expires_at, rpm=p.rpm, tpm=p.tpm,
            token_budget=p.token_budget, budget_period=p.budget_period, weight=p.weight,
            priority=p.priority.value,
        )  # fmt: skip


class KeysOutput(BaseModel):
    """``llmgw keys list --json``."""

    keys: list[KeyRow] = Field(description="by id")


class ModelsOutput(BaseModel):
    """``llmgw model list --json``: the catalog."""

    models: list[CatalogModel] = Field(description="by name")


def _when(epoch: int | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)


class BatchRow(BaseModel):
    """One batch (``/v1/batches``), any key's, as ``llmgw batches list`` lists it."""

    id: str
    key_id: int = Field(description="the client API key that made it")
    endpoint: str = Field(description="where its lines go: /v1/chat/completions, ...")
    status: str = Field(
        description="validating, in_progress, finalizing, completed, failed, expired,"
        " cancelling or cancelled"
    )
    total: int = Field(description="requests in its input file (0 until validated)")
    completed: int = Field(description="lines answered 2xx")
    failed: int = Field(description="lines answered with an error")
    created_at: datetime

    @classmethod
    def of(cls, record: "BatchRecord") -> "BatchRow":
        """The row of a stored batch."""
        return cls(**_row_fields(record))


def _row_fields(record: "BatchRecord") -> dict[str, object]:
    return {
        "id": record.id, "key_id": record.key_id, "endpoint": record.endpoint,
        "status": record.status, "total": record.total, "completed": record.completed,
        "failed": record.failed, "created_at": _when(record.created_at),
    }  # fmt: skip


class BatchesOutput(BaseModel):
    """``llmgw batches list --json``."""

    batches: list[BatchRow] = Field(description="newest first")
    has_more: bool = Field(description="more batches than --limit")


class BatchErrorRow(BaseModel):
    """One problem validation found in a batch's input file."""

    code: str | None
    line: int | None = Field(description="1-based line of the input file")
    message: str | None
    param: str | None = Field(description="the field at fault")


class BatchDetail(BatchRow):
    """One batch in full, as ``llmgw batches show`` shows it."""

    input_file_id: str
    output_file_id: str | None = Field(description="the answered lines (JSONL)")
    error_file_id: str | None = Field(description="the failed lines (JSONL)")
    expires_at: datetime | None
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None
    input_tokens: int
    output_tokens: int
    errors: list[BatchErrorRow] = Field(description="why validation failed it")
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, record: "BatchRecord") -> "BatchDetail":
        """The detail of a stored batch."""
        return cls(
            **_row_fields(record),
            input_file_id=record.input_file_id, output_file_id=record.output_file_id,
            error_file_id=record.error_file_id, expires_at=_when(record.expires_at),
            in_progress_at=_when(record.in_progress_at),
            finalizing_at=_when(record.finalizing_at), completed_at=_when(record.completed_at),
            failed_at=_when(record.failed_at), expired_at=_when(record.expired_at),
            cancelling_at=_when(record.cancelling_at), cancelled_at=_when(record.cancelled_at),
            input_tokens=record.input_tokens, output_tokens=record.output_tokens,
            errors=[BatchErrorRow.model_validate(e) for e in record.errors or []],
            metadata=record.meta,
        )  # fmt: skip


class BatchShowOutput(BaseModel):
    """``llmgw batches show ID --json``."""

    batch: BatchDetail


def print_json(shape: BaseModel) -> None:
    """Print ``shape`` on stdout as one JSON document: written as is, never
    through rich, which would colour it or wrap long strings."""
    sys.stdout.write(shape.model_dump_json(indent=2) + "\n")
