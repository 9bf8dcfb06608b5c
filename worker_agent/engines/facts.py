"""NodeFacts from what an agent already reports: its inventory."""

from collections.abc import Sequence

from llmgw.types import NodeInventory
from worker_agent.engines.nccl import chosen_ports
from worker_agent.engines.spec import NodeFacts


def node_facts(
    inventory: NodeInventory,
    gpu_indices: Sequence[int],
    http_port: int,
    host: str | None = None,
    threads: int = 0,
) -> NodeFacts:
    """The facts of a shard on ``inventory``'s node using ``gpu_indices``.

    ``host`` (the bind address) defaults to the node's advertised address.
    Only the active ports of the node's fabric are kept, so the plan never
    names a down adapter or one on another network.
    """
    fabric = inventory.fabric
    by_index = {g.index: g for g in inventory.gpus}
    return NodeFacts(
        host=host or inventory.address,
        advertise_address=inventory.address,
        management_interface=fabric.management_interface,
        http_port=http_port,
        fabric=fabric.kind,
        rdma_ports=tuple(chosen_ports(fabric.kind, fabric.ports)),
        gpu_indices=tuple(gpu_indices),
        gpus=tuple(by_index[i] for i in gpu_indices if i in by_index),
        threads=threads,
    )
