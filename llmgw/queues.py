"""Task queue names: built here only, so a typo cannot split a node in two."""

CONTROL_QUEUE = "control"
"""The control plane's task queue: workflows and control activities."""

FLEET_WORKFLOW_ID = "fleet"
"""The one fleet entity workflow: node inventory and the allocation ledger.
Its memo key for registered nodes is ``llmgw.contracts.FLEET_NODES_MEMO``."""


def node_queue(node_id: str) -> str:
    """The task queue a node agent serves its activities on."""
    if not node_id or any(c.isspace() for c in node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"node-{node_id}"


def deployment_workflow_id(model: str) -> str:
    """The workflow id of a model's deployment."""
    return f"deployment/{model}"


def replica_workflow_id(replica_id: str) -> str:
    """The workflow id of a replica's lifecycle."""
    return f"replica/{replica_id}"


EXEC_QUEUE = "exec"
"""Durable OpenAI jobs (batches, background responses): their workflows and
activities, served by the control worker. Apart from ``control`` so that a
busy batch never delays a placement, and so jobs can get workers of their own."""


def batch_workflow_id(batch_id: str) -> str:
    """The workflow id of a batch (``/v1/batches``): one per batch, ever."""
    return f"batch/{batch_id}"


def response_workflow_id(response_id: str) -> str:
    """The workflow id of a background response (``/v1/responses``)."""
    return f"response/{response_id}"
