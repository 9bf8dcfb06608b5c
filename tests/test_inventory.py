"""Node inventory: NVML where a driver exists, a CPU-only node where not."""

from llmgw.types import GpuInfo
from worker_agent.inventory import NvmlProbe, collect, memory_mib


class RecordedProbe:
    """A GPU probe answering from a recorded snapshot."""

    def __init__(self, gpus: list[GpuInfo]) -> None:
        self._gpus = gpus

    def gpus(self) -> tuple[list[GpuInfo], str]:
        return self._gpus, f"recorded: {len(self._gpus)} GPUs"


def test_this_machine_without_driver_is_a_cpu_node() -> None:
    gpus, note = NvmlProbe().gpus()
    # The CI and developer machines have no NVIDIA driver: no crash, a reason.
    assert gpus == []
    assert "CPU-only" in note


def test_collect_reports_gpus_and_cpu() -> None:
    h100 = GpuInfo(index=0, uuid="GPU-1", name="NVIDIA H100 80GB HBM3", memory_mib=81559)
    inv = collect("n1", "10.0.0.5", RecordedProbe([h100]), max_cpu_replicas=2)
    assert inv.node_id == "n1" and inv.address == "10.0.0.5"
    assert inv.gpus == [h100]
    assert inv.cpu_count >= 1 and inv.memory_mib > 0
    assert inv.gpu_discovery == "recorded: 1 GPUs"


def test_meminfo_parsing() -> None:
    assert memory_mib("MemTotal:       24576000 kB\nMemFree: 1 kB\n") == 24000
    assert memory_mib("") == 0
