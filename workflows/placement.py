"""Placement: a pure filter-then-score choice of a node for a replica.

Each filter says why it turned a node down, so "cannot be placed" always
comes with reasons. Bin-packing (prefer the busiest node that still fits)
keeps whole nodes free for large models.
"""

from collections.abc import Callable, Mapping

from llmgw.types import ModelSpec, NodeInventory, Placement, PlaceResult, Rejection

Filter = Callable[[NodeInventory, ModelSpec, list[Placement]], str | None]


def free_gpu_indices(node: NodeInventory, allocations: list[Placement]) -> list[int]:
    """Healthy GPUs on ``node`` that no allocation holds."""
    taken = {i for a in allocations for i in a.gpu_indices}
    return [g.index for g in node.gpus if g.healthy and g.index not in taken]


def _enough_gpus(node: NodeInventory, model: ModelSpec, allocs: list[Placement]) -> str | None:
    if model.gpus == 0:
        return None
    free = free_gpu_indices(node, allocs)
    if len(free) < model.gpus:
        return f"needs {model.gpus} free healthy GPUs, has {len(free)}"
    return None


def _cpu_slots(node: NodeInventory, model: ModelSpec, allocs: list[Placement]) -> str | None:
    if model.gpus > 0:
        return None
    cpu_replicas = sum(1 for a in allocs if not a.gpu_indices)
    if cpu_replicas >= node.max_cpu_replicas:
        return f"CPU replica slots full ({cpu_replicas}/{node.max_cpu_replicas})"
    return None


FILTERS: tuple[Filter, ...] = (_enough_gpus, _cpu_slots)


def _score(node: NodeInventory, allocs: list[Placement]) -> tuple[int, str]:
    # Bin-pack: more replicas already on the node scores higher; the node id
    # breaks ties so the choice is deterministic (workflow code replays it).
    return (len(allocs), node.node_id)


def choose_node(
    replica_id: str,
    model: ModelSpec,
    nodes: Mapping[str, NodeInventory],
    allocations: Mapping[str, Placement],
) -> PlaceResult:
    """Pick a node for ``replica_id``; idempotent when it is already placed."""
    existing = allocations.get(replica_id)
    if existing is not None:
        return PlaceResult(placement=existing)
    by_node: dict[str, list[Placement]] = {n: [] for n in nodes}
    for alloc in allocations.values():
        by_node.setdefault(alloc.node_id, []).append(alloc)
    rejections: list[Rejection] = []
    candidates: list[NodeInventory] = []
    for node in sorted(nodes.values(), key=lambda n: n.node_id):
        reason = next(
            (r for f in FILTERS if (r := f(node, model, by_node[node.node_id])) is not None),
            None,
        )
        if reason is None:
            candidates.append(node)
        else:
            rejections.append(Rejection(node_id=node.node_id, reason=reason))
    if not candidates:
        if not nodes:
            rejections.append(Rejection(node_id="*", reason="no node has registered"))
        return PlaceResult(rejections=rejections)
    best = max(candidates, key=lambda n: _score(n, by_node[n.node_id]))
    gpus = free_gpu_indices(best, by_node[best.node_id])[: model.gpus]
    return PlaceResult(
        placement=Placement(
            replica_id=replica_id, model=model.name, node_id=best.node_id, gpu_indices=gpus
        ),
        rejections=rejections,
    )
