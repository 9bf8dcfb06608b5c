"""The ModelPull job: a model's pinned weights fetched to nodes ahead of a deploy."""

from pydantic import BaseModel, Field

from llmgw.types.model import ModelSpec
from llmgw.types.replica import ReplicaTimeouts


class ModelPullInput(BaseModel):
    """Fetch ``model``'s weights (and install its engine) on each of ``nodes``."""

    model: ModelSpec
    nodes: list[str] = Field(min_length=1)
    timeouts: ReplicaTimeouts = Field(default_factory=ReplicaTimeouts)


class NodePull(BaseModel):
    """One node's outcome."""

    node_id: str
    ok: bool
    size_bytes: int = 0
    cached: bool = Field(default=False, description="the node held the weights already")
    reason: str = Field(default="", description="why the fetch failed")


class ModelPullResult(BaseModel):
    """Every node's outcome, in the order asked."""

    model: str
    nodes: list[NodePull]


def pull_activity_id(node_id: str) -> str:
    """The fetch activity's id for ``node_id``: how progress is told apart per node."""
    return f"fetch-{node_id}"
