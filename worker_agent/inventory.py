"""What this node has: GPUs (NVML), its fabric (sysfs), CPU and memory.

NVML and sysfs sit behind injectable sources so tests feed recorded
snapshots; a node without the NVIDIA driver is a CPU node, and a node
without InfiniBand is a single-node island, neither an error.
"""

import logging
import os
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from llmgw.path_filter import OPAQUE, PathFilter
from llmgw.types import (
    EngineCapability,
    GpuInfo,
    NodeInventory,
    WeightsEntry,
    WeightsReport,
)
from worker_agent.fabric import discover_fabric
from worker_agent.gpus import (
    GpuDiscoveryUnavailable,
    NvmlSource,
    PynvmlSource,
    RecordedSource,
    discover,
)
from worker_agent.installs.llamacpp import LlamaCppInstall

log = logging.getLogger(__name__)

# How far the weights roots are walked for a registration: enough to name the
# models there (a file, or a directory and its files), in a filter of a size
# fixed by WEIGHTS_LIMIT (llmgw.path_filter), and at most REFUSED_LIMIT paths
# the agent would refuse, with why.
WEIGHTS_DEPTH = 3
WEIGHTS_LIMIT = 1024
REFUSED_LIMIT = 32


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


def engine_capabilities(llama: LlamaCppInstall | None) -> list[EngineCapability]:
    """What this node's engine installs can do, for placement.

    A llama.cpp replica spans nodes only through ggml-rpc-server, which the
    portable (AVX2) install lacks, as its llama-server lacks ``--rpc``.
    """
    capabilities = []
    if llama is not None and llama.rpc_server is not None:
        capabilities.append(EngineCapability.LLAMA_CPP_RPC)
    return capabilities


def weights_report(
    roots: Sequence[Path],
    depth: int = WEIGHTS_DEPTH,
    limit: int = WEIGHTS_LIMIT,
    access: Callable[[str, int], bool] = os.access,
) -> WeightsReport:
    """The weights roots and what lies in them (``depth`` levels, ``limit`` paths),
    with the paths the agent would refuse as a source and why.

    ``llmgw model apply`` checks a catalog's sources against these, so an
    entry the agent will refuse is refused when it is applied, not at a
    replica's first start. Links are not followed into directories (a loop,
    or a tree outside the roots); a link is checked where it leads. ``access``
    is ``os.access``: whether this process (the agent) may read a path.
    """
    resolved = [os.path.realpath(r) for r in roots]
    found = PathFilter.for_paths(limit)
    refused: list[WeightsEntry] = []
    count = 0
    complete = True

    def inside(path: str) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in resolved)

    def walk(directory: str, level: int) -> None:
        nonlocal complete, count
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if count >= limit:
                complete = False
                return
            item = _weights_entry(entry, inside, access)
            if item is None:
                continue
            count += 1
            if item.problem and len(refused) >= REFUSED_LIMIT:
                complete = False  # left out of the filter too: unknown, not fine
                continue
            found.add(entry.path)
            if item.problem:
                refused.append(item)
            elif item.kind == "dir":
                if level < depth and not entry.is_symlink():
                    walk(entry.path, level + 1)
                else:
                    found.add(OPAQUE + entry.path)

    for root in resolved:
        walk(root, 1)
    return WeightsReport(
        roots=resolved,
        depth=depth,
        complete=complete,
        found=found.encode(),
        found_bits=found.bits,
        refused=refused,
    )


def _weights_entry(
    entry: os.DirEntry[str], inside: Callable[[str], bool], access: Callable[[str, int], bool]
) -> WeightsEntry | None:
    """One path found, with why the agent would refuse it ("" if it would not);
    None for what is neither a file nor a directory (a socket). A dangling
    link is refused, naming its target."""
    real = os.path.realpath(entry.path)
    if entry.is_symlink() and not os.path.exists(real):
        return WeightsEntry(path=entry.path, kind="file", problem=f"links to {real}, which is gone")
    is_dir = os.path.isdir(real)
    if not is_dir and not os.path.isfile(real):
        return None
    kind: Literal["file", "dir"] = "dir" if is_dir else "file"
    problem = ""
    if not inside(real):
        problem = f"resolves to {real}, outside the weights roots"
    elif not access(real, os.R_OK | (os.X_OK if is_dir else 0)):
        problem = "not readable by the agent"
    return WeightsEntry(path=entry.path, kind=kind, problem=problem)
