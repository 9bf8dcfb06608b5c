"""Keeping the allocation ledger true to what runs, as pure functions.

The ledger is the fleet workflow's state, so a control-plane restart loses
nothing. What it guards against is losing the fleet workflow itself
(terminated, or its namespace restored from an old backup): agents report
every engine they run each time they (re)register, and any engine the ledger
does not know is added back, so its GPUs are not handed out a second time.
"""

from llmgw.types import NodeInventory, Placement, ShardPlacement


def rebuild_from_report(allocations: dict[str, Placement], node: NodeInventory) -> list[str]:
    """Add to ``allocations`` the shards ``node`` runs that it lacks; returns them.

    A worker rank is added once its leader's allocation exists; if the
    worker's node reports first, the next registration round adds it.
    """
    added: list[str] = []
    for shard in node.running:
        held = allocations.get(shard.replica_id)
        if shard.rank == 0 and held is None:
            allocations[shard.replica_id] = Placement(
                replica_id=shard.replica_id,
                model=shard.model,
                node_id=node.node_id,
                gpu_indices=shard.gpu_indices,
                priority=shard.priority,
            )
            added.append(f"{shard.replica_id}/0")
        elif (
            shard.rank > 0 and held is not None and shard.rank not in {w.rank for w in held.workers}
        ):
            held.workers.append(
                ShardPlacement(rank=shard.rank, node_id=node.node_id, gpu_indices=shard.gpu_indices)
            )
            added.append(f"{shard.replica_id}/{shard.rank}")
    return added
