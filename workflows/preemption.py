"""Preemption, as a pure function: whom to drain so a replica fits.

A replica that cannot be placed may take the room of replicas of lower
priority. The fleet reserves that room for it at once (so the GPUs the
victims give back cannot go to anyone else), and the preempting replica asks
the victims to drain. Victims are chosen lowest priority first; among the
plans that work, the one with the fewest victims wins, then the one
disturbing the lowest priorities. A replica already promised to one
preemptor is never promised to a second.

A multi-node replica preempts node by node inside one fabric island (its
ranks must share a fabric): it needs ``profile.nodes`` nodes of one island
that fit it once their victims are gone. Only single-node replicas are ever
victims: draining a multi-node one frees room on several nodes at once,
most of which the preemptor would not use.
"""

from collections.abc import Mapping

from llmgw.types import ModelSpec, NodeInventory, Placement, Reservation, ShardPlacement
from workflows.placement import (
    by_node,
    free_gpu_indices,
    island_of,
    ranks_over_network,
    rejection,
)


def reserved_key(preemptor: str) -> str:
    """The key room reserved for ``preemptor`` is held under among the claims."""
    return f"reserved:{preemptor}"


def claims(
    allocations: Mapping[str, Placement], reservations: Mapping[str, Reservation]
) -> dict[str, Placement]:
    """Everything that holds room: allocations and reserved room alike."""
    held = dict(allocations)
    for preemptor, reservation in reservations.items():
        held[reserved_key(preemptor)] = reservation.placement
    return held


class _NodePlan:
    """Whom to drain on one node so that one rank fits there."""

    def __init__(self, node: NodeInventory, victims: list[Placement], free: list[int]) -> None:
        self.node = node
        self.victims = victims
        self.free = free

    def key(self) -> tuple[int, int, str]:
        """Fewest victims, then the lowest priorities disturbed, then the node id."""
        worst = max((v.priority for v in self.victims), default=-1)
        return (len(self.victims), worst, self.node.node_id)


def _node_plan(
    replica_id: str,
    model: ModelSpec,
    node: NodeInventory,
    allocations: Mapping[str, Placement],
    reservations: Mapping[str, Reservation],
) -> _NodePlan | None:
    """The fewest lowest-priority victims on ``node`` that make one rank fit (None: none do)."""
    promised = {v for r in reservations.values() for v in r.victims}
    pool = sorted(
        (
            a
            for a in allocations.values()
            if a.node_id == node.node_id
            and not a.workers
            and a.priority < model.priority
            and a.replica_id not in promised
            and a.replica_id != replica_id
        ),
        key=lambda a: (a.priority, a.replica_id),
    )
    remaining = claims(allocations, reservations)
    victims: list[Placement] = []
    for victim in pool:
        if rejection(node, model, by_node(remaining).get(node.node_id, [])) is None:
            break
        victims.append(victim)
        del remaining[victim.replica_id]
    held = by_node(remaining).get(node.node_id, [])
    if rejection(node, model, held) is not None:
        return None
    return _NodePlan(node, victims, free_gpu_indices(node, held, model.gpu_class)[: model.gpus])


def _reservation(replica_id: str, model: ModelSpec, ranks: list[_NodePlan]) -> Reservation:
    leader, workers = ranks[0], ranks[1:]
    return Reservation(
        placement=Placement(
            replica_id=replica_id,
            model=model.name,
            node_id=leader.node.node_id,
            gpu_indices=leader.free,
            workers=[
                ShardPlacement(rank=rank, node_id=p.node.node_id, gpu_indices=p.free)
                for rank, p in enumerate(workers, start=1)
            ],
            priority=model.priority,
        ),
        victims=[v.replica_id for p in ranks for v in p.victims],
    )


def plan_preemption(
    replica_id: str,
    model: ModelSpec,
    nodes: Mapping[str, NodeInventory],
    allocations: Mapping[str, Placement],
    reservations: Mapping[str, Reservation],
    *,
    multi_node: bool = True,
) -> Reservation | None:
    """The room to reserve for ``replica_id`` and whom to drain for it, or None.

    ``multi_node=False`` keeps the rule of fleets that began before
    multi-node preemption (a multi-node replica then only waits).
    """
    wanted = model.profile.nodes
    if wanted > 1 and not multi_node:
        return None
    islands: dict[str, list[_NodePlan]] = {}
    over_network = wanted > 1 and ranks_over_network(model)
    for node in sorted(nodes.values(), key=lambda n: n.node_id):
        plan = _node_plan(replica_id, model, node, allocations, reservations)
        if plan is not None:
            # One node alone is its own "island": any node will do.
            island = island_of(node, over_network) if wanted > 1 else node.node_id
            islands.setdefault(island, []).append(plan)
    best: tuple[tuple[int, int, str], list[_NodePlan]] | None = None
    for island, plans in sorted(islands.items()):
        if len(plans) < wanted:
            continue
        ranks = sorted(plans, key=_NodePlan.key)[:wanted]
        victims = [v for p in ranks for v in p.victims]
        if not victims:
            continue  # it fits without preempting: placement's job, not ours
        key = (len(victims), max(v.priority for v in victims), island)
        if best is None or key < best[0]:
            best = (key, ranks)
    return _reservation(replica_id, model, best[1]) if best else None
