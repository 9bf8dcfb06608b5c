"""GPU discovery through NVML: a raw snapshot first, health and class derived from it.

Two layers, so the rules can be tested without a GPU:

* a *source* (:class:`NvmlSource`) returns a :class:`NodeGpuSnapshot`, the plain facts
  NVML reports. :class:`PynvmlSource` asks the driver; :class:`RecordedSource` reads a
  JSON file in the same shape (tests, demos, reports from the field). To record a node::

      python -c "from worker_agent.gpus import PynvmlSource as S; \\
                 print(S().snapshot().model_dump_json(indent=2))"

* :func:`discover` turns a snapshot into the :class:`~llmgw.types.GpuInfo` records the
  scheduler sees, deciding health; :func:`gpu_class` names the kind of GPU.
"""

import contextlib
import functools
import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from llmgw.errors import LlmgwError
from llmgw.types import GpuHealth, GpuInfo

MIB = 1024**2
GIB = 1024**3

# NVML return codes from nvml.h: part of the driver ABI, stable across versions, so a
# fake library in tests only has to carry the numbers.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
# nvmlMemoryErrorType_t / nvmlEccCounterType_t for nvmlDeviceGetTotalEccErrors. Volatile
# counts since the driver loaded: a reset or reboot (the remedy) clears it, whereas the
# aggregate counter would keep a repaired GPU flagged for ever.
_MEMORY_ERROR_UNCORRECTED = 1
_VOLATILE_ECC = 0

T = TypeVar("T")


class GpuDiscoveryUnavailable(LlmgwError):
    """NVML cannot be used on this node (no library, no driver, driver too old).

    Not an error for the agent: such a node is a CPU node, and ``reason`` says why.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GpuProcess(BaseModel):
    """A process holding a context on a GPU."""

    model_config = ConfigDict(extra="forbid")

    pid: int = Field(description="as the host sees it: NVML does not map PID namespaces")
    used_memory_bytes: int | None = Field(
        default=None, description="None when the driver will not say (e.g. no permission)"
    )


class RawGpu(BaseModel):
    """One device as NVML reported it; fields stay at their defaults when unknown."""

    model_config = ConfigDict(extra="forbid")

    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = Field(default="", description='e.g. "00000000:18:00.0"')
    memory_total_bytes: int = 0
    compute_capability: tuple[int, int] | None = Field(default=None, description="(major, minor)")
    ecc_uncorrected: int | None = Field(
        default=None, description="volatile total; None when ECC is unsupported or disabled"
    )
    processes: list[GpuProcess] = Field(default_factory=list, description="compute + graphics")
    lost: bool = Field(default=False, description="GPU_IS_LOST, or a query on it failed")
    error: str = Field(default="", description="the failed query and NVML's message")


class NodeGpuSnapshot(BaseModel):
    """Everything NVML said about a node's GPUs at one moment."""

    model_config = ConfigDict(extra="forbid")

    driver_version: str = ""
    gpus: list[RawGpu] = Field(default_factory=list)


class NvmlSource(Protocol):
    """Where snapshots come from: the driver, or a recording."""

    def snapshot(self) -> NodeGpuSnapshot:
        """The node's GPUs now; raises GpuDiscoveryUnavailable when NVML is unusable."""
        ...


# The part of pynvml this module uses, spelled out so that tests can hand PynvmlSource a
# fake library. Read-only properties let plain (frozen) dataclasses satisfy them.
class _MemoryInfo(Protocol):
    @property
    def total(self) -> int: ...


class _PciInfo(Protocol):
    @property
    def busId(self) -> str | bytes: ...


class _ProcessInfo(Protocol):
    @property
    def pid(self) -> int: ...
    @property
    def usedGpuMemory(self) -> int | None: ...


class NvmlLibrary(Protocol):
    """The pynvml functions and exception types :class:`PynvmlSource` calls."""

    @property
    def NVMLError(self) -> type[Exception]: ...
    @property
    def NVMLLibraryMismatchError(self) -> type[Exception]: ...
    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> object: ...
    def nvmlDeviceGetUUID(self, handle: object) -> str | bytes: ...
    def nvmlDeviceGetName(self, handle: object) -> str | bytes: ...
    def nvmlDeviceGetPciInfo(self, handle: object) -> _PciInfo: ...
    def nvmlDeviceGetMemoryInfo(self, handle: object) -> _MemoryInfo: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: object) -> tuple[int, int]: ...
    def nvmlDeviceGetTotalEccErrors(
        self, handle: object, error_type: int, counter_type: int
    ) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> Sequence[_ProcessInfo]: ...
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: object) -> Sequence[_ProcessInfo]: ...


class PynvmlSource:
    """Snapshots from the NVIDIA driver through pynvml (package nvidia-ml-py).

    ``nvml`` defaults to the real ``pynvml`` module; tests pass a fake. A failure on one
    device marks that device lost instead of failing the node, so the operator sees it.
    """

    def __init__(self, nvml: NvmlLibrary | None = None) -> None:
        self._nvml = nvml

    def snapshot(self) -> NodeGpuSnapshot:
        """Initialise NVML, read every device, shut NVML down again."""
        nvml = self._nvml if self._nvml is not None else _import_pynvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, NoPermission...
            raise GpuDiscoveryUnavailable(
                f"NVML did not initialise: {exc} ({type(exc).__name__})"
            ) from exc
        try:
            return _read_node(nvml)
        finally:
            # A failed shutdown must not throw away a good snapshot.
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()


class RecordedSource:
    """Snapshots from a JSON file in :class:`NodeGpuSnapshot`'s shape."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def snapshot(self) -> NodeGpuSnapshot:
        """The recorded snapshot (a missing or malformed file raises as usual)."""
        return NodeGpuSnapshot.model_validate_json(self.path.read_text())


def _import_pynvml() -> NvmlLibrary:
    try:
        import pynvml  # noqa: PLC0415 - only needed when the real driver is asked
    except ImportError as exc:
        raise GpuDiscoveryUnavailable(f"pynvml is not installed: {exc}") from exc
    lib: NvmlLibrary = pynvml
    return lib


def _read_node(nvml: NvmlLibrary) -> NodeGpuSnapshot:
    driver = ""
    with contextlib.suppress(nvml.NVMLError):  # only informative: never worth failing for
        driver = _text(nvml.nvmlSystemGetDriverVersion())
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        raise GpuDiscoveryUnavailable(f"NVML could not count GPUs: {exc}") from exc
    try:
        gpus = [_read_device(nvml, index) for index in range(count)]
    except nvml.NVMLLibraryMismatchError as exc:
        # pynvml calls versioned entry points (e.g. process lists _v3) that a very old
        # driver lacks: a node-wide condition, not a broken device.
        raise GpuDiscoveryUnavailable(f"driver too old for nvidia-ml-py: {exc}") from exc
    return NodeGpuSnapshot(driver_version=driver, gpus=gpus)


def _read_device(nvml: NvmlLibrary, index: int) -> RawGpu:
    """One device; queries run from most to least basic so a failure keeps what came before."""
    gpu = RawGpu(index=index)
    step = "device handle"
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        step = "identity"
        gpu.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        gpu.name = _text(nvml.nvmlDeviceGetName(handle))
        gpu.pci_bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        step = "memory"
        gpu.memory_total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        step = "compute capability"
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        gpu.compute_capability = (int(major), int(minor))
        step = "ECC counters"
        gpu.ecc_uncorrected = _unless_unsupported(
            nvml,
            functools.partial(
                nvml.nvmlDeviceGetTotalEccErrors, handle, _MEMORY_ERROR_UNCORRECTED, _VOLATILE_ECC
            ),
        )
        step = "processes"
        gpu.processes = _processes(nvml, handle)
    except nvml.NVMLError as exc:
        # GPU_IS_LOST (Xid 79, fallen off the bus) and friends: whatever the code, a device
        # we cannot query must not be handed out, so it is reported lost with the reason.
        gpu.lost = True
        gpu.error = f"{step}: {exc}"
    return gpu


def _processes(nvml: NvmlLibrary, handle: object) -> list[GpuProcess]:
    """Compute and graphics processes, one entry per pid.

    A process doing both appears in both lists; it keeps the larger figure known.
    Listing is unsupported on some boards: that reads as no processes.
    """
    found: dict[int, GpuProcess] = {}
    for query in (
        nvml.nvmlDeviceGetComputeRunningProcesses,
        nvml.nvmlDeviceGetGraphicsRunningProcesses,
    ):
        for proc in _unless_unsupported(nvml, functools.partial(query, handle)) or []:
            pid, used = int(proc.pid), proc.usedGpuMemory
            seen = found.get(pid)
            if seen is not None and seen.used_memory_bytes is not None:
                used = seen.used_memory_bytes if used is None else max(used, seen.used_memory_bytes)
            found[pid] = GpuProcess(pid=pid, used_memory_bytes=None if used is None else int(used))
    return list(found.values())


def _unless_unsupported(nvml: NvmlLibrary, call: Callable[[], T]) -> T | None:
    """``call()``, or None when NVML answers NOT_SUPPORTED; other errors propagate."""
    try:
        return call()
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) == NVML_ERROR_NOT_SUPPORTED:
            return None
        raise


def _text(value: str | bytes) -> str:
    # pynvml returned bytes before 11.x; tolerate both.
    return value.decode() if isinstance(value, bytes) else value


# Vendor and brand words, then package / memory-type words: the same chip sold as SXM or
# PCIe, with HBM3 or HBM2e, must give one class (the size comes from the driver instead).
_DROPPED_WORD = re.compile(
    r"nvidia|geforce|tesla|quadro|generation|pcie|nvlink|nvl|sxm\d?|hbm\d?e?|gddr\d+x?|\d+gb"
)


def gpu_class(name: str, memory_total_bytes: int) -> str:
    """A short class for a GPU: ``<model>-<GiB>g``, e.g. ``"l40s-45g"``.

    Rule:

    * model: the marketing name lower-cased and split on anything not a letter or
      digit; drop vendor words (nvidia, geforce, tesla, quadro), package and memory
      words (sxm*, pcie, nvl, nvlink, hbm*, gddr*, "generation") and sizes such as
      "80gb"; join the rest with no separator ("NVIDIA RTX 6000 Ada Generation" gives
      "rtx6000ada"). Nothing left gives "gpu".
    * size: the total memory the driver reports, in GiB, rounded half up. The driver's
      figure, not the box's, because it decides whether a model fits: "NVIDIA L40S"
      (48305799168 B, 44.99 GiB) is ``l40s-45g``, "NVIDIA H100 80GB HBM3" (79.65 GiB)
      ``h100-80g``, "NVIDIA H200" (143771 MiB, 140.4 GiB) ``h200-140g``, and both
      "NVIDIA A100-SXM4-40GB" and "NVIDIA A100-PCIE-40GB" (40 GiB) ``a100-40g``.
    """
    words = re.split(r"[^a-z0-9]+", name.lower())
    model = "".join(word for word in words if word and not _DROPPED_WORD.fullmatch(word))
    gib = (memory_total_bytes + GIB // 2) // GIB  # integer half-up: round() is half-even
    return f"{model or 'gpu'}-{gib}g"


def discover(snapshot: NodeGpuSnapshot, engine_pids: Collection[int]) -> list[GpuInfo]:
    """The scheduler's view of a snapshot's GPUs, in index order, with health flags.

    ``engine_pids`` are the pids our engines run as, their children included (vLLM and
    SGLang hold GPUs from worker processes): any other process on a GPU is foreign. They
    must be host pids, as NVML reports, so the agent needs the host's PID namespace.

    Flags, most severe first: LOST when the device could not be queried,
    ECC_UNCORRECTED when the volatile uncorrected count is above zero, FOREIGN_PROCESS
    when a process outside ``engine_pids`` uses it. ``health_detail`` says the same in
    words. A lost GPU is still listed, with whatever NVML told before it failed.
    """
    engines = frozenset(engine_pids)
    return [_gpu_info(raw, engines) for raw in sorted(snapshot.gpus, key=lambda g: g.index)]


def _gpu_info(raw: RawGpu, engines: frozenset[int]) -> GpuInfo:
    flags: list[GpuHealth] = []
    reasons: list[str] = []
    if raw.lost:
        flags.append(GpuHealth.LOST)
        reasons.append(f"lost ({raw.error or 'no detail from NVML'})")
    if raw.ecc_uncorrected:
        flags.append(GpuHealth.ECC_UNCORRECTED)
        plural = "" if raw.ecc_uncorrected == 1 else "s"
        reasons.append(f"{raw.ecc_uncorrected} uncorrected ECC error{plural}")
    foreign = [proc for proc in raw.processes if proc.pid not in engines]
    if foreign:
        flags.append(GpuHealth.FOREIGN_PROCESS)
        reasons.extend(_describe(proc) for proc in foreign)
    capability = ""
    if raw.compute_capability is not None:
        capability = f"{raw.compute_capability[0]}.{raw.compute_capability[1]}"
    # Without both name and memory a class would be a guess, and a wrong class could
    # place a model on a GPU it does not fit.
    known = bool(raw.name) and raw.memory_total_bytes > 0
    return GpuInfo(
        index=raw.index,
        uuid=raw.uuid,
        name=raw.name,
        memory_mib=raw.memory_total_bytes // MIB,
        pci_bus_id=raw.pci_bus_id,
        compute_capability=capability,
        gpu_class=gpu_class(raw.name, raw.memory_total_bytes) if known else "",
        health_flags=flags,
        health_detail="; ".join(reasons),
    )


def _describe(proc: GpuProcess) -> str:
    if proc.used_memory_bytes is None:
        return f"pid {proc.pid} holds an unknown amount of memory"
    return f"pid {proc.pid} holds {proc.used_memory_bytes / GIB:.1f} GiB"
