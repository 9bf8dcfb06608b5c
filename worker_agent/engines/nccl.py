"""NCCL / Gloo fabric environment and GPU selection for one shard.

Checked against the NCCL user guide, "Environment Variables"
(docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html, 2.23+ pages):
``NCCL_SOCKET_IFNAME`` and ``NCCL_IB_HCA`` are *prefix* lists unless an entry
starts with ``=`` (``mlx5_1`` also matches ``mlx5_10`` .. ``mlx5_17``), and an
HCA entry may name its port as ``device:port``. Gloo's ``GLOO_SOCKET_IFNAME``
takes plain interface names, so it gets no ``=``.

Why each variable:

* ``NCCL_IB_HCA`` lists only the chosen fabric's active ports. Left open, NCCL
  may pick an adapter on another network (a storage RoCE NIC next to the
  InfiniBand ones) where the peer is unreachable, and the job hangs.
* ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` name *this node's* management
  interface: interface names differ between nodes, so one name for all of
  them sends some nodes' bootstrap traffic nowhere.
* ``NCCL_IB_GID_INDEX`` on RoCE only: NCCL's default entry is usually a v1
  link-local GID, which does not route; the RoCE v2 entry holding an IPv4
  address does. InfiniBand addresses by LID and needs none.
* No fabric: ``NCCL_IB_DISABLE=1``, so NCCL uses sockets instead of probing
  RDMA devices it cannot use.
* ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: the agent's GPU indices come from NVML,
  which numbers by PCI bus; CUDA's default order is fastest-first, so without
  it ``CUDA_VISIBLE_DEVICES=2`` can be another shard's GPU on a mixed node.
"""

from collections.abc import Iterable, Sequence

from llmgw.types import FabricKind, LinkLayer, RdmaPort
from worker_agent.engines.spec import LaunchValidationError, NodeFacts

_ACTIVE = "ACTIVE"
_LAYER = {FabricKind.INFINIBAND: LinkLayer.INFINIBAND, FabricKind.ROCE: LinkLayer.ETHERNET}

# Variables a plan decides; an inherited value would describe another node,
# another shard or another fabric, so the agent's own are never passed on.
OWNED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NCCL_IB_HCA",
        "NCCL_IB_GID_INDEX",
        "NCCL_IB_DISABLE",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
    }
)


def chosen_ports(kind: FabricKind, ports: Iterable[RdmaPort]) -> list[RdmaPort]:
    """The active ports of fabric ``kind``: a down port or one of another link layer
    (an Ethernet port on an InfiniBand node) cannot reach the peers."""
    layer = _LAYER.get(kind)
    return [p for p in ports if p.state == _ACTIVE and p.link_layer is layer]


def ib_hca(ports: Sequence[RdmaPort]) -> str:
    """``NCCL_IB_HCA`` in exact-match form: ``=mlx5_0:1,mlx5_1:1``."""
    return "=" + ",".join(f"{p.device}:{p.port}" for p in ports)


def fabric_problems(node: NodeFacts, *, allow_tcp: bool = False) -> list[str]:
    """Why this node cannot take part in a multi-node NCCL job, in words; [] when it can."""
    problems: list[str] = []
    if not node.management_interface:
        problems.append(
            f"node {node.peer_address} has no management interface: NCCL_SOCKET_IFNAME "
            "and GLOO_SOCKET_IFNAME need the interface holding its management address "
            "(check the agent's management address)"
        )
    if node.fabric is FabricKind.NONE:
        if not allow_tcp:
            problems.append(
                f"node {node.peer_address} has no InfiniBand/RoCE fabric: place the replica "
                "on fabric nodes, or set allow_tcp in the profile to accept plain TCP"
            )
        return problems
    ports = chosen_ports(node.fabric, node.rdma_ports)
    if not ports:
        problems.append(
            f"node {node.peer_address} reports a {node.fabric.value} fabric but no active "
            f"{node.fabric.value} port: check the links (ibstat) or the node's inventory"
        )
    elif node.fabric is FabricKind.ROCE:
        problems.extend(_gid_problems(node, ports))
    return problems


def _gid_problems(node: NodeFacts, ports: Sequence[RdmaPort]) -> list[str]:
    missing = [p.device for p in ports if p.roce_v2_ipv4_gid_index is None]
    if missing:
        return [
            f"node {node.peer_address}: RoCE port(s) {', '.join(missing)} have no RoCE v2 "
            "GID with an IPv4 address: give their net devices an IPv4 address"
        ]
    indices = {p.roce_v2_ipv4_gid_index for p in ports}
    if len(indices) > 1:
        listing = ", ".join(f"{p.device}={p.roce_v2_ipv4_gid_index}" for p in ports)
        return [
            f"node {node.peer_address}: RoCE ports disagree on the RoCE v2 IPv4 GID index "
            f"({listing}) and NCCL_IB_GID_INDEX takes one value: configure the ports alike"
        ]
    return []


def roce_gid_index(ports: Sequence[RdmaPort]) -> int:
    """The one RoCE v2 IPv4 GID index all ``ports`` share; LaunchValidationError otherwise."""
    indices = {p.roce_v2_ipv4_gid_index for p in ports}
    if len(indices) != 1 or None in indices:
        listing = ", ".join(f"{p.device}={p.roce_v2_ipv4_gid_index}" for p in ports)
        raise LaunchValidationError(
            [f"RoCE ports need one shared RoCE v2 IPv4 GID index, found: {listing or 'none'}"]
        )
    (index,) = indices
    assert index is not None
    return index


def fabric_env(node: NodeFacts, *, allow_tcp: bool = False) -> dict[str, str]:
    """The NCCL/Gloo variables for this node's shard of a multi-node replica.

    Raises LaunchValidationError (with every problem) when the node's facts
    would give NCCL a configuration that hangs instead of failing.
    """
    problems = fabric_problems(node, allow_tcp=allow_tcp)
    if problems:
        raise LaunchValidationError(problems)
    env = {
        "NCCL_SOCKET_IFNAME": f"={node.management_interface}",
        "GLOO_SOCKET_IFNAME": node.management_interface,
    }
    if node.fabric is FabricKind.NONE:
        env["NCCL_IB_DISABLE"] = "1"
        return env
    ports = chosen_ports(node.fabric, node.rdma_ports)
    env["NCCL_IB_HCA"] = ib_hca(ports)
    if node.fabric is FabricKind.ROCE:
        env["NCCL_IB_GID_INDEX"] = str(roce_gid_index(ports))
    return env


def gpu_env(gpu_indices: Sequence[int]) -> dict[str, str]:
    """GPU selection: exactly the shard's GPUs, numbered as NVML numbers them.

    A shard without GPUs gets an empty list, so a CPU engine built with CUDA
    does not initialise (and take memory on) a GPU another shard was given.
    """
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_indices),
    }
