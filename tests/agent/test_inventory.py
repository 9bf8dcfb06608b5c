"""Node inventory: recorded GPUs and fabrics, and this (GPU-less) machine."""

from llmgw.types import FabricKind
from tests.harness import FIXTURES
from worker_agent.gpus import PynvmlSource, RecordedSource
from worker_agent.inventory import Sources, collect, gpus, memory_mib


def test_this_machine_without_driver_is_a_cpu_node() -> None:
    found, note = gpus(PynvmlSource(), engine_pids=())
    assert found == []
    assert "CPU-only" in note


def test_collect_from_recorded_h100_node_on_infiniband() -> None:
    sources = Sources(
        gpus=RecordedSource(FIXTURES / "gpus" / "8xH100-SXM.json"),
        sys_root=FIXTURES / "sysfs" / "ib-8x-ndr",
        interfaces={"lo": ["127.0.0.1"], "bond0": ["10.1.0.7"]},
    )
    inv = collect("h100-a", "10.1.0.7", sources, engine_pids=range(48213, 48221))
    assert len(inv.gpus) == 8 and all(g.healthy for g in inv.gpus)
    assert {g.gpu_class for g in inv.gpus} == {"h100-80g"}
    assert inv.fabric.kind is FabricKind.INFINIBAND
    assert inv.fabric.management_interface == "bond0"
    assert inv.cpu_count >= 1 and inv.memory_mib > 0


def test_foreign_processes_and_ecc_reported_in_the_note() -> None:
    found, note = gpus(RecordedSource(FIXTURES / "gpus" / "ecc-errors.json"), engine_pids=())
    assert [g.index for g in found if not g.healthy] == [2]
    assert "GPU 2: 3 uncorrected ECC errors" in note


def test_node_without_ib_is_a_single_node_island() -> None:
    sources = Sources(
        gpus=RecordedSource(FIXTURES / "gpus" / "4xL40S.json"),
        sys_root=FIXTURES / "sysfs" / "none",
        interfaces={"eth0": ["192.0.2.10"]},
    )
    inv = collect("l40s-a", "192.0.2.10", sources)
    assert inv.fabric.kind is FabricKind.NONE
    assert inv.fabric.island == "node:192.0.2.10"


def test_meminfo_parsing() -> None:
    assert memory_mib("MemTotal:       24576000 kB\nMemFree: 1 kB\n") == 24000
    assert memory_mib("") == 0
