"""GPU discovery: recorded snapshots of real node shapes, the class rule, and the NVML
source against the real (absent) driver and a fake library passed in."""

import ctypes
from dataclasses import dataclass, field

import pytest

from llmgw.types import GpuHealth, GpuInfo
from tests.harness import FIXTURES
from worker_agent.gpus import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    GpuDiscoveryUnavailable,
    NodeGpuSnapshot,
    NvmlSource,
    PynvmlSource,
    RecordedSource,
    discover,
    gpu_class,
)

GPUS = FIXTURES / "gpus"
GIB = 1024**3
H100_BYTES = 85520809984
L40S_BYTES = 48305799168

H100_ENGINE_PIDS = range(48213, 48221)  # the vLLM workers recorded in 8xH100-SXM.json


def load(name: str) -> NodeGpuSnapshot:
    source: NvmlSource = RecordedSource(GPUS / name)
    return source.snapshot()


# --- recorded nodes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "count", "gpu_classes", "capabilities"),
    [
        ("8xH100-SXM.json", 8, {"h100-80g"}, {"9.0"}),
        ("8xA100-40GB.json", 8, {"a100-40g"}, {"8.0"}),
        ("4xL40S.json", 4, {"l40s-45g"}, {"8.9"}),
        ("mixed-node.json", 4, {"a100-80g", "l40s-45g", ""}, {"8.0", "8.9", ""}),
        ("ecc-errors.json", 4, {"a100-80g"}, {"8.0"}),
    ],
)
def test_every_fixture_discovers(
    fixture: str, count: int, gpu_classes: set[str], capabilities: set[str]
) -> None:
    snapshot = load(fixture)
    gpus = discover(snapshot, engine_pids=())
    assert len(gpus) == count
    assert [g.index for g in gpus] == list(range(count))
    assert {g.gpu_class for g in gpus} == gpu_classes
    assert {g.compute_capability for g in gpus} == capabilities
    assert len({g.uuid for g in gpus}) == count
    assert all(g.uuid.startswith("GPU-") and len(g.uuid) == 40 for g in gpus)
    assert snapshot.driver_version
    # The fixture is exactly the model's JSON shape: it survives a round trip.
    assert NodeGpuSnapshot.model_validate_json(snapshot.model_dump_json()) == snapshot


def test_h100_node_running_our_engine_is_healthy() -> None:
    gpus = discover(load("8xH100-SXM.json"), engine_pids=H100_ENGINE_PIDS)
    assert all(g.healthy for g in gpus), [g.health_detail for g in gpus]
    first = gpus[0]
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory_mib == 81559
    assert first.pci_bus_id == "00000000:18:00.0"
    assert first.health_detail == ""


def test_processes_outside_engine_pids_are_foreign() -> None:
    # Same node, but the agent does not know those workers: every GPU is taken.
    gpus = discover(load("8xH100-SXM.json"), engine_pids={1, 2})
    assert all(g.health_flags == [GpuHealth.FOREIGN_PROCESS] for g in gpus)
    assert gpus[3].health_detail == "pid 48216 holds 71.6 GiB"


def test_idle_a100_node() -> None:
    gpus = discover(load("8xA100-40GB.json"), engine_pids=())
    assert all(g.healthy and g.memory_mib == 40960 for g in gpus)
    assert gpus[7].pci_bus_id == "00000000:BD:00.0"


def test_l40s_without_ecc_is_not_flagged() -> None:
    snapshot = load("4xL40S.json")
    assert all(raw.ecc_uncorrected is None for raw in snapshot.gpus)
    # One engine process spans GPUs 0 and 1.
    gpus = discover(snapshot, engine_pids={3301})
    assert [g.healthy for g in gpus] == [True] * 4
    assert {g.memory_mib for g in gpus} == {46068}
    assert [g.healthy for g in discover(snapshot, engine_pids=())] == [False, False, True, True]


def test_mixed_node_foreign_process_and_lost_gpu() -> None:
    gpus = discover(load("mixed-node.json"), engine_pids={7781})
    a100, shared, l40s, lost = gpus
    assert a100.healthy and l40s.healthy
    assert a100.gpu_class == "a100-80g" and l40s.gpu_class == "l40s-45g"
    assert shared.health_flags == [GpuHealth.FOREIGN_PROCESS]
    assert shared.health_detail == (
        "pid 24017 holds 2.0 GiB; pid 24390 holds an unknown amount of memory"
    )
    # The lost GPU is still listed with what NVML knew, and never gets a class.
    assert lost.health_flags == [GpuHealth.LOST]
    assert lost.health_detail == "lost (memory: GPU is lost)"
    assert lost.name == "NVIDIA L40S" and lost.pci_bus_id == "00000000:E3:00.0"
    assert lost.uuid.startswith("GPU-")
    assert (lost.gpu_class, lost.memory_mib, lost.compute_capability) == ("", 0, "")


def test_uncorrected_ecc_errors_flag_one_gpu() -> None:
    gpus = discover(load("ecc-errors.json"), engine_pids=())
    assert [g.healthy for g in gpus] == [True, True, False, True]
    assert gpus[2].health_flags == [GpuHealth.ECC_UNCORRECTED]
    assert gpus[2].health_detail == "3 uncorrected ECC errors"


def test_flags_combine_most_severe_first() -> None:
    raw = load("ecc-errors.json").gpus[2]
    raw = raw.model_copy(update={"lost": True, "error": "ECC counters: GPU is lost"})
    raw.processes = load("mixed-node.json").gpus[1].processes[:1]
    (info,) = discover(NodeGpuSnapshot(gpus=[raw]), engine_pids=())
    assert info.health_flags == [
        GpuHealth.LOST,
        GpuHealth.ECC_UNCORRECTED,
        GpuHealth.FOREIGN_PROCESS,
    ]
    assert info.health_detail == (
        "lost (ECC counters: GPU is lost); 3 uncorrected ECC errors; pid 24017 holds 2.0 GiB"
    )


# --- gpu_class ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "total", "expected"),
    [
        ("NVIDIA L40S", L40S_BYTES, "l40s-45g"),  # 44.99 GiB rounds up
        ("NVIDIA H100 80GB HBM3", H100_BYTES, "h100-80g"),  # 79.65 GiB
        ("NVIDIA H100 PCIe", H100_BYTES, "h100-80g"),
        ("NVIDIA H100 NVL", 100485038080, "h100-94g"),  # 95830 MiB
        ("NVIDIA H200", 150754820096, "h200-140g"),  # 143771 MiB = 140.4 GiB
        ("NVIDIA A100-SXM4-40GB", 42949672960, "a100-40g"),
        ("NVIDIA A100 80GB PCIe", 85899345920, "a100-80g"),
        ("Tesla V100-SXM2-16GB", 17179869184, "v100-16g"),
        ("Tesla T4", 16106127360, "t4-15g"),
        ("NVIDIA A10G", 24146608128, "a10g-22g"),  # 22.49 GiB rounds down
        ("NVIDIA GeForce RTX 4090", 25757220864, "rtx4090-24g"),
        ("NVIDIA RTX 6000 Ada Generation", 51527024640, "rtx6000ada-48g"),
        ("NVIDIA", 8 * GIB, "gpu-8g"),
    ],
)
def test_gpu_class(name: str, total: int, expected: str) -> None:
    assert gpu_class(name, total) == expected


def test_gpu_class_ignores_form_factor() -> None:
    sxm = gpu_class("NVIDIA A100-SXM4-40GB", 42949672960)
    pcie = gpu_class("NVIDIA A100-PCIE-40GB", 42949672960)
    assert sxm == pcie == "a100-40g"
    # ... but not memory: the 80 GB part is a different class.
    assert gpu_class("NVIDIA A100-SXM4-80GB", 85899345920) != sxm


def test_gpu_class_rounds_half_up() -> None:
    assert gpu_class("NVIDIA L4", 22 * GIB + GIB // 2) == "l4-23g"
    assert gpu_class("NVIDIA L4", 22 * GIB + GIB // 2 - 1) == "l4-22g"


# --- PynvmlSource -----------------------------------------------------------------------


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_real_pynvml_source_on_this_machine() -> None:
    if _driver_present():
        snapshot = PynvmlSource().snapshot()
        assert snapshot.driver_version and snapshot.gpus
        assert all(g.name.startswith("NVIDIA") for g in snapshot.gpus if not g.lost)
        return
    with pytest.raises(GpuDiscoveryUnavailable) as caught:
        PynvmlSource().snapshot()
    assert "Library Not Found" in caught.value.reason
    assert caught.value.reason == str(caught.value)


class FakeNvmlError(Exception):
    """Shaped like pynvml.NVMLError: the NVML return code in ``value``."""

    MESSAGES = {3: "Not Supported", 9: "Driver Not Loaded", 15: "GPU is lost"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self.MESSAGES.get(self.value, f"NVML error {self.value}")


class FakeMismatchError(Exception):
    """Shaped like pynvml.NVMLLibraryMismatchError."""


@dataclass(frozen=True)
class FakeMemory:
    total: int


@dataclass(frozen=True)
class FakePci:
    busId: str


@dataclass(frozen=True)
class FakeProcess:
    pid: int
    usedGpuMemory: int | None


@dataclass
class FakeDevice:
    """One device; ``failures`` maps a query name to the NVML code it fails with."""

    name: str = "NVIDIA H100 80GB HBM3"
    total: int = H100_BYTES
    capability: tuple[int, int] = (9, 0)
    ecc: int = 0
    compute: list[FakeProcess] = field(default_factory=list)
    graphics: list[FakeProcess] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    mismatch: bool = False


class FakeNvml:
    """A pynvml stand-in: handles are indices into ``devices``."""

    NVMLError = FakeNvmlError
    NVMLLibraryMismatchError = FakeMismatchError

    def __init__(self, devices: list[FakeDevice], init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.shutdown_error: int | None = None
        self.calls: list[str] = []

    def _query(self, handle: object, query: str) -> FakeDevice:
        assert isinstance(handle, int)
        device = self.devices[handle]
        if query in device.failures:
            raise FakeNvmlError(device.failures[query])
        return device

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")
        if self.shutdown_error is not None:
            raise FakeNvmlError(self.shutdown_error)

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.90.07"  # old pynvml returned bytes

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        self._query(index, "handle")
        return index

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        self._query(handle, "uuid")
        return f"GPU-0000000{handle}-1111-2222-3333-444444444444"

    def nvmlDeviceGetName(self, handle: object) -> str:
        return self._query(handle, "name").name

    def nvmlDeviceGetPciInfo(self, handle: object) -> FakePci:
        self._query(handle, "pci")
        return FakePci(busId=f"00000000:{0x18 + int(str(handle)):02X}:00.0")

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> FakeMemory:
        return FakeMemory(total=self._query(handle, "memory").total)

    def nvmlDeviceGetCudaComputeCapability(self, handle: object) -> tuple[int, int]:
        return self._query(handle, "capability").capability

    def nvmlDeviceGetTotalEccErrors(
        self, handle: object, error_type: int, counter_type: int
    ) -> int:
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return self._query(handle, "ecc").ecc

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[FakeProcess]:
        device = self._query(handle, "compute")
        if device.mismatch:
            raise FakeMismatchError("use nvmlDeviceGetComputeRunningProcesses_v2")
        return device.compute

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: object) -> list[FakeProcess]:
        return self._query(handle, "graphics").graphics


def test_fake_library_healthy_node() -> None:
    fake = FakeNvml([FakeDevice(compute=[FakeProcess(900, 10 * GIB)]), FakeDevice()])
    snapshot = PynvmlSource(fake).snapshot()
    assert snapshot.driver_version == "550.90.07"
    assert [g.pci_bus_id for g in snapshot.gpus] == ["00000000:18:00.0", "00000000:19:00.0"]
    assert snapshot.gpus[0].compute_capability == (9, 0)
    gpus = discover(snapshot, engine_pids={900})
    assert [(g.gpu_class, g.compute_capability, g.healthy) for g in gpus] == [
        ("h100-80g", "9.0", True)
    ] * 2
    assert fake.calls == ["init", "shutdown"]


def test_device_that_cannot_be_reached_is_lost_not_fatal() -> None:
    fake = FakeNvml([FakeDevice(), FakeDevice(failures={"handle": NVML_ERROR_GPU_IS_LOST})])
    snapshot = PynvmlSource(fake).snapshot()
    good, gone = snapshot.gpus
    assert not good.lost and good.memory_total_bytes == H100_BYTES
    assert gone.lost and gone.index == 1 and gone.uuid == "" and gone.memory_total_bytes == 0
    assert gone.error == "device handle: GPU is lost"
    info = discover(snapshot, engine_pids=())[1]
    assert info.health_flags == [GpuHealth.LOST] and info.gpu_class == ""
    assert fake.calls == ["init", "shutdown"]


def test_failure_midway_keeps_what_was_read() -> None:
    fake = FakeNvml([FakeDevice(failures={"memory": NVML_ERROR_GPU_IS_LOST})])
    (gpu,) = PynvmlSource(fake).snapshot().gpus
    assert gpu.lost and gpu.error == "memory: GPU is lost"
    assert gpu.name == "NVIDIA H100 80GB HBM3" and gpu.uuid.startswith("GPU-")
    assert gpu.compute_capability is None


def test_ecc_not_supported_is_none_but_other_ecc_errors_mean_lost() -> None:
    fake = FakeNvml(
        [
            FakeDevice(failures={"ecc": NVML_ERROR_NOT_SUPPORTED}),
            FakeDevice(failures={"ecc": NVML_ERROR_GPU_IS_LOST}),
            FakeDevice(ecc=2),
        ]
    )
    unsupported, broken, counted = PynvmlSource(fake).snapshot().gpus
    assert unsupported.ecc_uncorrected is None and not unsupported.lost
    assert broken.lost and broken.error == "ECC counters: GPU is lost"
    assert counted.ecc_uncorrected == 2 and not counted.lost


def test_process_lists_are_merged_per_pid() -> None:
    # A process doing compute and graphics is listed twice: keep the larger known figure.
    device = FakeDevice(
        compute=[FakeProcess(10, 5 * GIB), FakeProcess(11, None), FakeProcess(13, 3 * GIB)],
        graphics=[FakeProcess(10, 4 * GIB), FakeProcess(12, GIB), FakeProcess(13, None)],
    )
    fake = FakeNvml([device, FakeDevice(failures={"compute": NVML_ERROR_NOT_SUPPORTED})])
    busy, unsupported = PynvmlSource(fake).snapshot().gpus
    assert sorted((p.pid, p.used_memory_bytes) for p in busy.processes) == [
        (10, 5 * GIB),
        (11, None),
        (12, GIB),
        (13, 3 * GIB),
    ]
    assert unsupported.processes == [] and not unsupported.lost


def test_no_driver_is_unavailable_with_a_reason() -> None:
    fake = FakeNvml([FakeDevice()], init_error=9)
    with pytest.raises(GpuDiscoveryUnavailable, match="Driver Not Loaded"):
        PynvmlSource(fake).snapshot()
    assert fake.calls == ["init"]  # nothing to shut down


def test_driver_too_old_for_the_bindings_is_unavailable() -> None:
    fake = FakeNvml([FakeDevice(mismatch=True)])
    with pytest.raises(GpuDiscoveryUnavailable, match="driver too old"):
        PynvmlSource(fake).snapshot()
    assert fake.calls == ["init", "shutdown"]


def test_gpu_info_from_discover_serialises() -> None:
    (info,) = discover(load("ecc-errors.json"), engine_pids=())[2:3]
    again = GpuInfo.model_validate_json(info.model_dump_json())
    assert again == info and not again.healthy


def test_failed_shutdown_keeps_the_snapshot() -> None:
    fake = FakeNvml([FakeDevice()])
    fake.shutdown_error = NVML_ERROR_GPU_IS_LOST
    (gpu,) = PynvmlSource(fake).snapshot().gpus
    assert gpu.name == "NVIDIA H100 80GB HBM3" and not gpu.lost
    assert fake.calls == ["init", "shutdown"]
