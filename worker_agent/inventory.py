"""What this node has: GPUs through NVML (when a driver exists), CPU and memory.

NVML sits behind a small protocol so tests can feed recorded snapshots; a
node without the NVIDIA driver is a CPU node, not an error.
"""

import logging
import os
import socket
from typing import Protocol

from llmgw.types import GpuInfo, NodeInventory

log = logging.getLogger(__name__)


class GpuProbe(Protocol):
    """Lists the node's GPUs, or explains why there are none."""

    def gpus(self) -> tuple[list[GpuInfo], str]:
        """The GPUs, and a human-readable note on how they were found."""
        ...


class NvmlProbe:
    """GPU discovery through pynvml (the nvidia-ml-py package)."""

    def gpus(self) -> tuple[list[GpuInfo], str]:
        """GPUs from NVML; an empty list with the reason when NVML is absent."""
        try:
            import pynvml  # noqa: PLC0415 - absent drivers are the common CPU case

            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return [], f"no NVIDIA driver ({type(exc).__name__}): CPU-only node"
        try:
            found: list[GpuInfo] = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                found.append(
                    GpuInfo(
                        index=index,
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        name=_text(pynvml.nvmlDeviceGetName(handle)),
                        memory_mib=int(mem.total) // (1024 * 1024),
                    )
                )
            return found, f"NVML: {len(found)} GPUs"
        finally:
            pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def memory_mib(meminfo: str) -> int:
    """MemTotal from /proc/meminfo text, in MiB."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 0


def collect(node_id: str, address: str, probe: GpuProbe, max_cpu_replicas: int) -> NodeInventory:
    """The node's inventory as the control plane sees it."""
    gpus, note = probe.gpus()
    log.info("node %s: %s", node_id, note)
    try:
        with open("/proc/meminfo") as fh:
            mem = memory_mib(fh.read())
    except OSError:
        mem = 0
    return NodeInventory(
        node_id=node_id,
        hostname=socket.gethostname(),
        address=address,
        cpu_count=os.cpu_count() or 1,
        memory_mib=mem,
        gpus=gpus,
        gpu_discovery=note,
        max_cpu_replicas=max_cpu_replicas,
    )
