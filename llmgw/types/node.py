"""What a node is: its GPUs, its fabric, and what its agent reports."""

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field


class GpuHealth(StrEnum):
    """Why a GPU must not be handed out."""

    ECC_UNCORRECTED = "ecc_uncorrected"
    FOREIGN_PROCESS = "foreign_process"
    LOST = "lost"


class GpuInfo(BaseModel):
    """One GPU as the agent saw it."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    pci_bus_id: str = ""
    compute_capability: str = Field(default="", description='e.g. "9.0"')
    gpu_class: str = Field(default="", description='name + GiB the driver reports, e.g. "l40s-45g"')
    health_flags: list[GpuHealth] = Field(default_factory=list)
    health_detail: str = ""

    @property
    def healthy(self) -> bool:
        """Whether the GPU may be handed out."""
        return not self.health_flags


class LinkLayer(StrEnum):
    """What an RDMA port runs over."""

    INFINIBAND = "InfiniBand"
    ETHERNET = "Ethernet"  # RoCE


class Gid(BaseModel):
    """One entry of a port's GID table."""

    index: int
    gid: str
    type: str = Field(default="", description='"IB/RoCE v1" or "RoCE v2"')
    netdev: str = ""


class RdmaPort(BaseModel):
    """One port of an InfiniBand / RoCE adapter."""

    device: str
    port: int
    state: str = Field(description='e.g. "ACTIVE"')
    phys_state: str = ""
    rate_gbps: float = 0.0
    link_layer: LinkLayer
    netdev: str = Field(default="", description="the net device behind a RoCE port")
    gids: list[Gid] = Field(default_factory=list)
    roce_v2_ipv4_gid_index: int | None = Field(
        default=None, description="the RoCE v2 GID holding an IPv4 address (NCCL_IB_GID_INDEX)"
    )


class FabricKind(StrEnum):
    """How a node talks to its peers for collective operations."""

    INFINIBAND = "infiniband"
    ROCE = "roce"
    NONE = "none"


class NodeFabric(BaseModel):
    """A node's high-speed fabric and management interface."""

    kind: FabricKind = FabricKind.NONE
    ports: list[RdmaPort] = Field(default_factory=list)
    management_interface: str = ""
    management_address: str = ""
    island: str = Field(default="", description="nodes in one island can form multi-node replicas")


class ShardRef(BaseModel):
    """Names a shard on a node."""

    replica_id: str
    rank: int = 0


class ShardReport(BaseModel):
    """An engine an agent runs, as it reports it when (re)registering."""

    replica_id: str
    rank: int
    pid: int
    endpoint: str
    model: str = ""
    gpu_indices: list[int] = Field(default_factory=list)
    priority: int = 0
    catalog_digest: str = Field(default="", description="the catalog entry it was started from")


class EngineInstallInfo(BaseModel):
    """An engine installed on a node: what, which version, and where."""

    engine: str = Field(description='"llama.cpp" or "vllm"')
    package: str = Field(description="the distribution or source it came from")
    version: str
    path: str = Field(description="the binary or virtual environment on the node")


class EngineCapability(StrEnum):
    """What a node's engine installs can do beyond serving one node's replica."""

    # ggml-rpc-server is installed and llama-server can use remote devices
    # (--rpc): a llama.cpp replica may span this node. The portable (AVX2)
    # llama.cpp has neither.
    LLAMA_CPP_RPC = "llama.cpp-rpc"


class WeightsEntry(BaseModel):
    """A path under the node's weights roots that the agent would refuse as a source."""

    path: str = Field(description="absolute path under a (resolved) root, as listed")
    kind: Literal["file", "dir"]
    problem: str = Field(description="why the agent would refuse it")


class WeightsReport(BaseModel):
    """What a catalog's sources may name on this node: the roots and what lies in them.

    What lies there is a Bloom filter (llmgw.path_filter) of the paths found,
    plus ``opaque:<dir>`` for each directory whose contents were not walked (a
    link, or deeper than ``depth``): a few KiB whatever the roots hold, as the
    fleet keeps every node's inventory.
    """

    roots: list[str] = Field(default_factory=list, description="LLMGW_WEIGHTS_ROOTS, resolved")
    depth: int = Field(default=0, ge=0, description="levels below each root that were walked")
    complete: bool = Field(
        default=True, description="False when more paths were found than the filter was made for"
    )
    found: str = Field(default="", description="base64 Bloom filter of the paths found")
    found_bits: int = Field(default=0, ge=0, description="the filter's size in bits")
    refused: list[WeightsEntry] = Field(
        default_factory=list, description="paths found that the agent would refuse (bounded)"
    )


class NodeInventory(BaseModel):
    """What an agent reports when it registers: the scheduler's view of a node."""

    node_id: str
    hostname: str
    address: str = Field(description="address engines on this node are reached at")
    cpu_count: int
    memory_mib: int
    gpus: list[GpuInfo] = Field(default_factory=list)
    gpu_discovery: str = Field(default="", description="why the GPU list is what it is")
    max_cpu_replicas: int = Field(default=4, ge=0)
    fabric: NodeFabric = Field(default_factory=NodeFabric)
    running: list[ShardReport] = Field(default_factory=list)
    lost: list[ShardRef] = Field(
        default_factory=list, description="shards whose engine this agent found gone at start"
    )
    engines: list[EngineInstallInfo] = Field(
        default_factory=list, description="engines installed on the node"
    )
    # None, not []: an agent from before capabilities were reported. Placement
    # then assumes it has them all, as it did, so old histories replay alike.
    capabilities: list[EngineCapability] | None = Field(
        default=None, description="what the node's engine installs can do (None: not reported)"
    )
    weights: WeightsReport | None = Field(
        default=None, description="the weights roots and their contents (None: not reported)"
    )
    peer_url: str = Field(
        default="", description="the agent's weights peer server, for other agents; empty: none"
    )
