"""The engines a node agent runs: installed on the node, on demand, cached.

llama.cpp is provisioned when the agent starts (seconds with the wheel). vLLM
is a multi-gigabyte venv, so it is installed the first time a replica needs it
(the replica's fetch step, which heartbeats and has an hours-long bound), then
found in the engine cache by every later start and every later agent.
"""

import importlib.metadata
import threading
from collections.abc import Callable
from pathlib import Path

from llmgw.types import EngineInstallInfo, EngineKind
from worker_agent.engines import EnginePlanner, Launchers, VllmPlanner, default_planners
from worker_agent.installs.llamacpp import (
    PORTABLE_PACKAGE,
    WHEEL_PACKAGE,
    LlamaCppInstall,
    find_llama_cpp,
)
from worker_agent.installs.llamacpp_build import SOURCE_PACKAGE, SOURCE_VERSION
from worker_agent.installs.vllm import (
    CPU_PACKAGE,
    GPU_PACKAGE,
    VllmInstall,
    ensure_vllm,
    find_vllm,
    package_for,
)

Progress = Callable[[str], None]


def llama_info(llama: LlamaCppInstall) -> EngineInstallInfo:
    """What the inventory says about the llama.cpp install."""
    if llama.source in ("wheel", "portable"):
        package = WHEEL_PACKAGE if llama.source == "wheel" else PORTABLE_PACKAGE
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    else:
        package, version = SOURCE_PACKAGE, SOURCE_VERSION
    return EngineInstallInfo(
        engine=EngineKind.LLAMA_CPP.value, package=package, version=version, path=str(llama.server)
    )


def vllm_info(install: VllmInstall) -> EngineInstallInfo:
    """What the inventory says about a vLLM venv."""
    return EngineInstallInfo(
        engine=EngineKind.VLLM.value,
        package=install.package,
        version=install.version,
        path=str(install.root),
    )


def installed_engines(cache_dir: Path) -> list[EngineInstallInfo]:
    """The engines installed here, found without installing or building anything."""
    llama = find_llama_cpp(cache_dir)
    found = [llama_info(llama)] if llama is not None else []
    for package in (CPU_PACKAGE, GPU_PACKAGE):
        vllm = find_vllm(cache_dir, package)
        if vllm is not None:
            found.append(vllm_info(vllm))
    return found


class EngineInstalls:
    """Where this node's engines are, installing vLLM when a replica first needs it."""

    def __init__(self, cache_dir: Path, llama: LlamaCppInstall) -> None:
        self.cache_dir = cache_dir
        self.llama = llama
        # One install at a time per agent; across agents the install's lock file serialises.
        self._lock = threading.Lock()

    def ensure(self, engine: EngineKind, device: str, progress: Progress | None = None) -> None:
        """Install what ``engine`` on ``device`` needs (blocking; a no-op once cached).

        Raises:
            EngineInstallError: the install failed; the message says why.
        """
        if engine is not EngineKind.VLLM:
            return  # llama.cpp is provisioned at agent start; SGLang is the operator's
        with self._lock:
            ensure_vllm(self.cache_dir, package_for(device), progress=progress)

    def vllm(self, device: str) -> VllmInstall | None:
        """The vLLM install for ``device``, if it is in the cache."""
        return find_vllm(self.cache_dir, package_for(device))

    def planners(self, device: str = "cpu") -> dict[EngineKind, EnginePlanner]:
        """The engine planners, their launchers pointing at this node's installs."""
        launchers = Launchers(
            llama_server=(str(self.llama.server),),
            rpc_server=(str(self.llama.rpc_server),)
            if self.llama.rpc_server
            else ("ggml-rpc-server",),
        )
        table = default_planners(launchers, {EngineKind.LLAMA_CPP: self.llama.environment})
        vllm = self.vllm(device)
        if vllm is not None:
            table[EngineKind.VLLM] = VllmPlanner(
                launchers.model_copy(update={"vllm": vllm.launcher()}), vllm.environment
            )
        return table

    def installed(self) -> list[EngineInstallInfo]:
        """Every engine installed on the node, for the inventory."""
        vllms = [e for e in installed_engines(self.cache_dir) if e.engine == EngineKind.VLLM.value]
        return [llama_info(self.llama), *vllms]
