"""Preemption, as a pure function: whom to drain so a replica fits.

A replica that cannot be placed may take the room of replicas of lower
priority. The fleet reserves that room for it at once (so the GPUs the
victims give back cannot go to anyone else), and the preempting replica asks
the victims to drain. Victims are chosen lowest priority first; across
nodes the plan with the fewest victims wins, then the one disturbing the
lowest priorities. A replica already promised to one preemptor is never
promised to a second. Only single-node replicas preempt or are preempted:
freeing a whole fabric island at once would disturb far more than it saves,
so a multi-node replica waits for room instead.
"""

from collections.abc import Mapping

from llmgw.types import ModelSpec, NodeInventory, Placement, Reservation
from workflows.placement import by_node, free_gpu_indices, rejection


def claims(
    allocations: Mapping[str, Placement], reservations: Mapping[str, Reservation]
) -> dict[str, Placement]:
    """Everything that holds room: allocations and reserved room alike."""
    held = dict(allocations)
    for preemptor, reservation in reservations.items():
        held[f"reserved:{preemptor}"] = reservation.placement
    return held


def plan_preemption(
    replica_id: str,
    model: ModelSpec,
    nodes: Mapping[str, NodeInventory],
    allocations: Mapping[str, Placement],
    reservations: Mapping[str, Reservation],
) -> Reservation | None:
    """The room to reserve for ``replica_id`` and whom to drain for it, or None."""
    if model.profile.nodes > 1:
        return None
    promised = {v for r in reservations.values() for v in r.victims}
    best: tuple[tuple[int, int, str], Reservation] | None = None
    for node in sorted(nodes.values(), key=lambda n: n.node_id):
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
        if not victims or rejection(node, model, held) is not None:
            continue
        key = (len(victims), max(v.priority for v in victims), node.node_id)
        plan = Reservation(
            placement=Placement(
                replica_id=replica_id,
                model=model.name,
                node_id=node.node_id,
                gpu_indices=free_gpu_indices(node, held, model.gpu_class)[: model.gpus],
                priority=model.priority,
            ),
            victims=[v.replica_id for v in victims],
        )
        if best is None or key < best[0]:
            best = (key, plan)
    return best[1] if best else None
