"""What this node has: GPUs (NVML), its fabric (sysfs), CPU and memory.

NVML and sysfs sit behind injectable sources so tests feed recorded
snapshots; a node without the NVIDIA driver is a CPU node, and a node
without InfiniBand is a single-node island, neither an error.
"""

import logging
import os
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.types import GpuInfo, NodeInventory
from worker_agent.fabric import discover_fabric
from worker_agent.gpus import (
    GpuDiscoveryUnavailable,
    NvmlSource,
    PynvmlSource,
    RecordedSource,
    discover,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sources:
    """Where discovery reads from: the real machine unless a test says otherwise."""

    gpus: NvmlSource = field(default_factory=PynvmlSource)
    sys_root: Path = Path("/sys")
    meminfo: Path = Path("/proc/meminfo")
    interfaces: Mapping[str, Sequence[str]] | None = None


def sources_from(sys_root: Path, gpu_snapshot: Path | None) -> Sources:
    """The real machine, or a recorded GPU snapshot / sysfs tree when given."""
    gpu_source: NvmlSource = RecordedSource(gpu_snapshot) if gpu_snapshot else PynvmlSource()
    return Sources(gpus=gpu_source, sys_root=sys_root)


def gpus(source: NvmlSource, engine_pids: Collection[int]) -> tuple[list[GpuInfo], str]:
    """The node's GPUs with health flags, and a note on how they were found."""
    try:
        snapshot = source.snapshot()
    except GpuDiscoveryUnavailable as exc:
        return [], f"no GPUs: {exc.reason} (CPU-only node)"
    found = discover(snapshot, engine_pids)
    unhealthy = [g for g in found if not g.healthy]
    note = f"NVML (driver {snapshot.driver_version}): {len(found)} GPUs"
    if unhealthy:
        note += "; unhealthy: " + "; ".join(f"GPU {g.index}: {g.health_detail}" for g in unhealthy)
    return found, note


def memory_mib(meminfo: str) -> int:
    """MemTotal from /proc/meminfo text, in MiB."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 0


def collect(
    node_id: str,
    address: str,
    sources: Sources,
    engine_pids: Collection[int] = (),
    max_cpu_replicas: int = 4,
    management_address: str = "",
) -> NodeInventory:
    """The node's inventory as the control plane sees it."""
    found, note = gpus(sources.gpus, engine_pids)
    log.info("node %s: %s", node_id, note)
    try:
        mem = memory_mib(sources.meminfo.read_text())
    except OSError:
        mem = 0
    fabric = discover_fabric(sources.sys_root, management_address or address, sources.interfaces)
    log.info(
        "node %s: fabric %s (%d RDMA ports), management interface %s",
        node_id,
        fabric.kind,
        len(fabric.ports),
        fabric.management_interface or "unknown",
    )
    return NodeInventory(
        node_id=node_id,
        hostname=socket.gethostname(),
        address=address,
        cpu_count=os.cpu_count() or 1,
        memory_mib=mem,
        gpus=found,
        gpu_discovery=note,
        max_cpu_replicas=max_cpu_replicas,
        fabric=fabric,
    )
