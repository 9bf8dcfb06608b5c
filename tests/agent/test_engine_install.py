"""Engine install: CPU-flag parsing, wheel choice, cache keys and the build cache.

The real source build takes minutes, so it is not run here; the cache, lock and
marker logic around it are exercised with staged build directories instead.
"""

import asyncio
import fcntl
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.types import ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child, wait_for
from tests.conftest import EngineWatch, source_build_wanted
from tests.harness import engine_cache, free_port, port_open
from worker_agent.engines import Launchers, LlamaCppPlanner, LoraAdapter, NodeFacts, ShardRequest
from worker_agent.installs import llamacpp as engine_install
from worker_agent.installs import llamacpp_build, portable_server, relocate
from worker_agent.installs.llamacpp import (
    LlamaCppInstall,
    cache_key,
    cpu_flags,
    ensure_llama_cpp,
    portable_supported,
    wheel_supported,
)
from worker_agent.installs.steps import MARKER, EngineInstallError, run_step
from worker_agent.supervisor import ENGINE_MARKER, TITLE_ENV
from worker_agent.users import reachable

# Recorded /proc/cpuinfo excerpts (one processor each, trailing fields trimmed).
SAPPHIRE_RAPIDS = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush \
dts acpi mmx fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art \
arch_perfmon pebs bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni \
pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 \
sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm \
3dnowprefetch cpuid_fault epb cat_l3 cat_l2 cdp_l3 invpcid_single intel_ppin cdp_l2 ssbd mba \
ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a \
avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw \
avx512vl xsaveopt xsavec xgetbv1 xsaves split_lock_detect avx_vnni avx512_bf16 wbnoinvd dtherm \
ida arat pln pts hwp hwp_act_window hwp_epp hwp_pkg_req avx512vbmi umip pku ospke waitpkg \
avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid \
bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig \
arch_lbr amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities
bugs\t\t: spectre_v1 spectre_v2 spec_store_bypass swapgs eibrs_pbrsb
bogomips\t: 4000.00
"""

COFFEE_LAKE_AVX2 = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush \
dts acpi mmx fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art \
arch_perfmon pebs bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 \
monitor ds_cpl vmx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid sse4_1 sse4_2 x2apic movbe popcnt \
tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb \
invpcid_single pti ssbd ibrs ibpb stibp fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid \
mpx rdseed adx smap clflushopt intel_pt xsaveopt xsavec xgetbv1 xsaves dtherm ida arat pln pts \
hwp hwp_notify hwp_act_window hwp_epp md_clear flush_l1d arch_capabilities
bugs\t\t: cpu_meltdown spectre_v1 spectre_v2 spec_store_bypass l1tf mds swapgs itlb_multihit
"""

GRAVITON2_AARCH64 = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

processor\t: 1
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
"""

SPR = cpu_flags(SAPPHIRE_RAPIDS)
AVX2 = cpu_flags(COFFEE_LAKE_AVX2)
ARM = cpu_flags(GRAVITON2_AARCH64)


def _this_machine_wheel_ok() -> bool:
    return sys.platform.startswith("linux") and wheel_supported(
        platform.machine(), engine_install._read_cpu_flags()
    )


# --- pure functions -----------------------------------------------------------------


def test_cpu_flags_parses_x86_flags_line() -> None:
    assert {"avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_int8"} <= SPR
    assert {"avx2", "fma", "f16c"} <= AVX2
    assert "avx512f" not in AVX2
    # Other "key: value" lines (bugs, model name) are not flags.
    assert "spectre_v1" not in SPR and "Intel(R)" not in SPR


def test_cpu_flags_parses_arm_features_line() -> None:
    assert {"fp", "asimd", "asimddp", "lrcpc"} <= ARM
    assert "0x41" not in ARM


def test_cpu_flags_keeps_only_what_every_processor_has() -> None:
    text = "processor : 0\nflags : sse2 avx2 avx512f\n\nprocessor : 1\nflags : sse2 avx2\n"
    assert cpu_flags(text) == frozenset({"sse2", "avx2"})
    assert cpu_flags("") == frozenset()
    assert cpu_flags("processor : 0\nmodel name : something\n") == frozenset()


def test_wheel_only_for_x86_with_the_avx512_extensions() -> None:
    assert wheel_supported("x86_64", SPR)
    assert not wheel_supported("x86_64", AVX2)
    assert not wheel_supported("aarch64", ARM)
    # Same flags, wrong architecture: the wheel is an x86 binary.
    assert not wheel_supported("aarch64", SPR)
    # Ice Lake-like: VBMI and VNNI but no BF16 -> SIGILL territory.
    assert not wheel_supported("x86_64", SPR - {"avx512_bf16"})
    for needed in ("avx512f", "avx512vbmi", "avx512_vnni"):
        assert not wheel_supported("x86_64", SPR - {needed}), needed


def test_cache_key_is_stable() -> None:
    key = cache_key("x86_64", SPR)
    assert key == cache_key("x86_64", frozenset(sorted(SPR, reverse=True)))
    assert key.startswith(f"x86_64-{llamacpp_build.SOURCE_VERSION}-")
    assert "/" not in key and len(key) < 64  # usable as one directory name


def test_cache_key_differs_by_cpu_source_and_arch() -> None:
    keys = {
        cache_key("x86_64", SPR),
        cache_key("x86_64", AVX2),
        cache_key("x86_64", SPR - {"avx512_bf16"}),
        cache_key("x86_64", SPR, version="1.0.0"),
        cache_key("aarch64", ARM),
        cache_key("aarch64", ARM - {"asimddp"}),
    }
    assert len(keys) == 6


def test_cache_key_ignores_flags_that_do_not_change_code() -> None:
    # Hypervisor, mitigations and TSC quirks change with kernels and microcode updates;
    # they must not cost a rebuild.
    noisy = SPR | {"hypervisor", "md_clear", "tsc_known_freq", "retbleed_mitigated"}
    assert cache_key("x86_64", noisy) == cache_key("x86_64", SPR - {"md_clear"})


def test_environment_returns_new_dict_and_wires_wheel_libs() -> None:
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"}
    wheel = LlamaCppInstall(Path("/w/bin/llama-server"), None, "wheel")
    env = wheel.environment(base)
    assert env["LD_LIBRARY_PATH"] == "/w/bin:/opt/lib"
    assert base["LD_LIBRARY_PATH"] == "/opt/lib"  # base untouched
    assert wheel.environment({})["LD_LIBRARY_PATH"] == "/w/bin"
    built = LlamaCppInstall(Path("/c/bin/llama-server"), None, "build")
    env = built.environment(base)
    assert env == base and env is not base


# --- the wheel on this machine -------------------------------------------------------


@pytest.mark.skipif(not _this_machine_wheel_ok(), reason="this CPU cannot run the wheel")
def test_wheel_chosen_here_and_runs(tmp_path: Path) -> None:
    found = ensure_llama_cpp(tmp_path / "cache")
    assert found.source == "wheel"
    assert found.rpc_server is not None
    env = found.environment(os.environ)
    for binary, arg in ((found.server, "--version"), (found.rpc_server, "--help")):
        run = subprocess.run(
            [str(binary), arg], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert run.returncode == 0, run.stdout + run.stderr
    assert not (tmp_path / "cache").exists()  # the wheel needs no cache


# --- the portable (AVX2) server ------------------------------------------------------


def test_portable_for_any_x86_with_avx2_and_nothing_older() -> None:
    avx2 = cpu_flags(COFFEE_LAKE_AVX2)
    assert portable_supported("x86_64", avx2) and not wheel_supported("x86_64", avx2)
    assert portable_supported("x86_64", SPR)  # AVX-512 machines could run it too
    assert not portable_supported("x86_64", avx2 - {"avx2"})  # Sandy/Ivy Bridge
    assert not portable_supported("x86_64", avx2 - {"f16c"})
    assert not portable_supported("aarch64", avx2)


def test_an_avx2_cpu_gets_the_portable_server_not_a_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_install, "_read_cpu_flags", lambda: cpu_flags(COFFEE_LAKE_AVX2))
    monkeypatch.setattr(engine_install, "_build", _no_build)
    lines: list[str] = []
    found = ensure_llama_cpp(tmp_path / "cache", progress=lines.append)
    assert found.source == "portable" and found.rpc_server is None
    assert found.server.parent.parent == (tmp_path / "cache" / "llama.cpp").resolve()
    assert os.access(found.server, os.X_OK) and "portable" in lines[0]
    assert engine_install.find_llama_cpp(tmp_path / "cache") == found


def test_the_portable_server_names_the_title_variable_the_supervisor_sets() -> None:
    """It imports nothing of llmgw, so it spells the name itself."""
    assert portable_server.TITLE_ENV == TITLE_ENV
    shown = portable_server.title(["-m", "m.gguf", "--api-key", "sk-x"], {TITLE_ENV: "llmgw r"})
    assert shown == "llama-server [llmgw r] -m m.gguf --api-key <redacted>"


def test_the_portable_launcher_runs_an_interpreter_every_user_can_run() -> None:
    """Engines may run as another user: pyenv's Python under a 0700 /root is not one."""
    python = relocate.engine_python()
    assert relocate.world_reachable(Path(python).resolve()), python
    run = subprocess.run(
        [python, "-c", "import sys; print(sys.version_info >= (3, 10))"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.stdout.strip() == "True"


def test_the_choice_can_be_forced_by_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_install, "_read_cpu_flags", lambda: cpu_flags(SAPPHIRE_RAPIDS))
    monkeypatch.setenv(engine_install.CHOICE_ENV, "portable")
    assert ensure_llama_cpp(tmp_path).source == "portable"
    monkeypatch.setenv(engine_install.CHOICE_ENV, "build")
    target = _stage_build(tmp_path)
    assert ensure_llama_cpp(tmp_path).server == target / "bin" / "llama-server"
    monkeypatch.setenv(engine_install.CHOICE_ENV, "fastest")
    with pytest.raises(EngineInstallError, match="LLMGW_LLAMA_CPP='fastest'"):
        ensure_llama_cpp(tmp_path)


def _this_machine_portable_ok() -> bool:
    return portable_supported(platform.machine(), engine_install._read_cpu_flags())


@pytest.mark.skipif(not _this_machine_portable_ok(), reason="this CPU has no AVX2")
def test_portable_server_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    found = ensure_llama_cpp(tmp_path, force_portable=True)
    for extra in (["--rpc", "10.0.0.2:50052"], ["--no-such-option"]):
        run = subprocess.run(
            [str(found.server), "--model", "/m.gguf", *extra],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert run.returncode == 2 and extra[0] in run.stderr, run.stderr


@pytest.mark.skipif(not _this_machine_portable_ok(), reason="this CPU has no AVX2")
async def test_portable_server_serves_what_the_engine_plan_asks(
    tmp_path: Path, tiny: TinyModel
) -> None:
    """The command llama.cpp's engine plan builds, run by the portable server:
    key, alias, LoRA adapters and metrics as llama-server would have them."""
    found = ensure_llama_cpp(tmp_path, force_portable=True)
    port = free_port()
    request = ShardRequest(
        model=ModelSpec(name="tiny", source=str(tiny.model_path), context_length=256),
        node=NodeFacts(host="127.0.0.1", advertise_address="127.0.0.1", http_port=port, threads=1),
        loras=tuple(LoraAdapter(name=n, path=str(p)) for n, p in tiny.adapters.items()),
    )
    planner = LlamaCppPlanner(Launchers(llama_server=(str(found.server),)))
    plan = planner.plan(request, "sk-engine-test", found.environment(os.environ))
    (command,) = plan.commands
    env = {**plan.env, TITLE_ENV: "llmgw llama.cpp replica r-9 rank 0", ENGINE_MARKER: "/m"}
    engine = Child("llama-server", list(command.argv), env, tmp_path / "engine.log")
    try:
        # Titled for ps: which replica, and llama-server's options, never the key
        # (issue 23: it showed as "python3 -s -c import sys; ..."); the
        # environment, where the agent looks for its engine marker, intact.
        proc = Path(f"/proc/{engine.pid}")
        titled = "llama-server [llmgw llama.cpp replica r-9 rank 0] --model"
        assert wait_for(lambda: (proc / "cmdline").read_bytes().startswith(titled.encode()), 60)
        shown = (proc / "cmdline").read_bytes().decode()
        assert "--alias tiny" in shown and "sk-engine-test" not in shown, shown
        assert f"{ENGINE_MARKER}=/m".encode() in (proc / "environ").read_bytes().split(b"\0")
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with asyncio.timeout(120):
                while not port_open(port) or (await http.get("/health")).status_code != 200:
                    assert engine.alive(), (tmp_path / "engine.log").read_text()
                    await asyncio.sleep(0.2)
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            }
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 401
            key = {"Authorization": "Bearer sk-engine-test"}
            r = await http.post("/v1/chat/completions", json=body, headers=key)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] > 0
            assert (await http.get("/v1/models", headers=key)).json()["data"][0]["id"] == "tiny"
            loras = (await http.get("/lora-adapters", headers=key)).json()
            assert [a["scale"] for a in loras] == [0.0, 0.0]
            metrics = await http.get("/metrics", headers=key)
            assert "llamacpp:prompt_tokens_total" in metrics.text
    finally:
        engine.stop()


# --- the real source build, once per CI run ------------------------------------------


@pytest.mark.skipif(
    not source_build_wanted(),
    reason="a real llama.cpp build (5-10 minutes on 2 cores): CI runs it once; here"
    " LLMGW_TEST_SOURCE_BUILD=1 does",
)
@pytest.mark.timeout(1800)
@pytest.mark.source_build
def test_the_source_build_builds_and_runs(tmp_path: Path) -> None:
    """Machines with neither wheel's CPU build it; CI has one of them, so it builds
    here (into the shared engine cache, so later runs on this machine reuse it)."""
    found = ensure_llama_cpp(engine_cache(), force_build=True, progress=print)
    assert found.source == "build" and found.rpc_server is not None
    for binary, arg in ((found.server, "--version"), (found.rpc_server, "--help")):
        run = subprocess.run(
            [str(binary), arg], capture_output=True, text=True, timeout=60, check=False
        )
        assert run.returncode == 0, run.stdout + run.stderr


# --- build cache, lock and helpers (no real build) -----------------------------------


def _stage_build(cache: Path, *, marker: bool = True) -> Path:
    """A build dir as a finished (or interrupted) build leaves it, for this machine."""
    key = cache_key(platform.machine(), engine_install._read_cpu_flags())
    target = cache.resolve() / "llama.cpp" / key
    (target / "bin").mkdir(parents=True)
    for name in llamacpp_build.TARGETS:
        script = target / "bin" / name
        script.write_text("#!/bin/sh\necho fake\n")
        script.chmod(0o755)
    if marker:
        (target / MARKER).write_text("{}\n")
    return target


def _no_build(target: Path, progress: object) -> LlamaCppInstall:
    raise AssertionError(f"unexpected build of {target}")


def test_completed_build_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _stage_build(tmp_path)
    monkeypatch.setattr(engine_install, "_build", _no_build)
    lines: list[str] = []
    found = ensure_llama_cpp(tmp_path, force_build=True, progress=lines.append)
    assert found == LlamaCppInstall(
        target / "bin" / "llama-server", target / "bin" / "ggml-rpc-server", "build"
    )
    assert any("cached" in line for line in lines)


def test_unmarked_build_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stage_build(tmp_path, marker=False)
    monkeypatch.setattr(engine_install, "_build", _no_build)
    with pytest.raises(AssertionError, match="unexpected build"):
        ensure_llama_cpp(tmp_path, force_build=True)


def test_waiter_reuses_the_build_finished_under_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_install, "_build", _no_build)
    key = cache_key(platform.machine(), engine_install._read_cpu_flags())
    (tmp_path / "llama.cpp").mkdir()
    lock = open(tmp_path / "llama.cpp" / f"{key}.lock", "a")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)  # another installer is mid-build

    def finish_build() -> None:
        time.sleep(0.5)
        _stage_build(tmp_path)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()

    builder = threading.Thread(target=finish_build)
    builder.start()
    lines: list[str] = []
    found = ensure_llama_cpp(tmp_path, force_build=True, progress=lines.append)
    builder.join()
    assert found.source == "build" and found.server.is_file()
    assert any("waiting" in line for line in lines)


def test_source_tree_is_the_llama_cpp_project(tmp_path: Path) -> None:
    archive = tmp_path / "pkg-1.0.tar.gz"
    files = {
        "pkg-1.0/setup.py": "",
        "pkg-1.0/llama.cpp/CMakeLists.txt": 'project("llama.cpp" C CXX)\n',
        "pkg-1.0/llama.cpp/ggml/CMakeLists.txt": 'project("ggml" C CXX)\n',
    }
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    src = llamacpp_build._source_tree(archive, tmp_path / "x")
    assert src == tmp_path / "x" / "pkg-1.0" / "llama.cpp"
    assert "-DLLAMA_CURL=OFF" not in llamacpp_build._configure_command(src, tmp_path / "b")
    (src / "CMakeLists.txt").write_text('project("llama.cpp")\noption(LLAMA_CURL "curl" ON)\n')
    assert "-DLLAMA_CURL=OFF" in llamacpp_build._configure_command(src, tmp_path / "b")


def test_failed_step_reports_log_path_and_tail(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    cmd = [sys.executable, "-c", "print('compiler says no'); raise SystemExit(3)"]
    with pytest.raises(EngineInstallError) as caught:
        run_step("cmake build", cmd, log)
    message = str(caught.value)
    assert str(log) in message and "compiler says no" in message and "exit 3" in message


def test_main_prints_the_server_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _stage_build(tmp_path)
    monkeypatch.setattr(engine_install, "_build", _no_build)
    assert engine_install.main(["--force-build", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(target / "bin" / "llama-server")


# --- a copy the engines' user can reach (a venv under root's 0700 home) -----------------

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")
NOBODY = 65534


def _nobody_reaches(path: Path) -> bool:
    return reachable(path, NOBODY, [NOBODY])


def _as_nobody(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture
def private_and_open(no_engine_outlives_its_test: EngineWatch) -> Iterator[tuple[Path, Path]]:
    """A 0700 directory (where ``make run`` puts the venv under /root) and one all may pass.

    Made in /tmp, not under ``tmp_path``: opening pytest's 0700 tmp dirs to all
    would let later tests' engine users reach work dirs they must not."""
    with no_engine_outlives_its_test.tmp_dir("llmgw-install-", 0o755) as top:
        private, shared = top / "private", top / "open"
        private.mkdir(mode=0o700)
        shared.mkdir()
        yield private, shared


def _private_copy(package: Path, private: Path) -> Path:
    """``package`` as a venv under a private dir would hold it (hard links: instant)."""
    copy = private / "site-packages" / package.name
    shutil.copytree(package, copy, copy_function=os.link)
    return copy


@root_only
@pytest.mark.skipif(not _this_machine_wheel_ok(), reason="this CPU cannot run the wheel")
def test_the_wheel_is_copied_where_the_engine_user_reaches_it(
    private_and_open: tuple[Path, Path],
) -> None:
    private, shared = private_and_open
    wheel = ensure_llama_cpp(shared / "unused")
    bin_dir = _private_copy(wheel.server.parent, private)
    rpc = bin_dir / "ggml-rpc-server"
    inside = LlamaCppInstall(bin_dir / "llama-server", rpc, "wheel")
    assert not _nobody_reaches(inside.server)
    lines: list[str] = []
    copy = engine_install.relocated(inside, shared / "cache", _nobody_reaches, lines.append)
    assert copy.source == "wheel" and copy.server.parent.parent.name.startswith("wheel-")
    assert copy.server.is_relative_to((shared / "cache").resolve()) and copy.rpc_server
    assert (copy.server.parent.parent / MARKER).is_file() and any("copying" in x for x in lines)
    for binary, arg in ((copy.server, "--version"), (copy.rpc_server, "--help")):
        run = _as_nobody(str(binary), arg, env=copy.environment({"PATH": "/usr/bin:/bin"}))
        assert run.returncode == 0, run.stdout + run.stderr
    # Once: the next agent finds it, and never copies over a complete one.
    again = engine_install.relocated(inside, shared / "cache", _nobody_reaches, lines.append)
    assert again == copy and sum("copying" in x for x in lines) == 2
    assert not list(copy.server.parent.parent.parent.glob(".*work-*"))


@root_only
@pytest.mark.skipif(not _this_machine_portable_ok(), reason="this CPU has no AVX2")
def test_the_portable_package_is_copied_beside_its_launcher(
    private_and_open: tuple[Path, Path],
) -> None:
    """The launcher imports xllamacpp from beside it, under an interpreter the user runs."""
    private, shared = private_and_open
    portable = ensure_llama_cpp(shared / "first", force_portable=True)
    python, package = portable.reads
    inside = LlamaCppInstall(
        portable.server, None, "portable", (python, _private_copy(package, private))
    )
    copy = engine_install.relocated(inside, shared / "cache", _nobody_reaches)
    assert copy.source == "portable" and all(_nobody_reaches(p) for p in copy.needs())
    beside = copy.server.parent / "xllamacpp"
    assert copy.reads == (python, beside)
    probe = f"import sys; sys.path[:0] = [{str(copy.server.parent)!r}]; import xllamacpp as x;"
    run = _as_nobody(str(python), "-s", "-c", probe + " print(x.__file__)")
    assert run.returncode == 0 and run.stdout.startswith(str(beside)), run.stderr
    # The launcher, as the user: it imports the copy (an unknown option: exit 2, no server).
    refused = _as_nobody(str(copy.server), "--model", "/m.gguf", "--rpc", "h:1")
    assert refused.returncode == 2 and "--rpc" in refused.stderr, refused.stderr


def test_a_source_build_is_copied_not_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build takes minutes: the moved cache gets the finished one's binaries."""
    built = _stage_build(tmp_path / "first")
    monkeypatch.setattr(engine_install, "_build", _no_build)
    install = ensure_llama_cpp(tmp_path / "first", force_build=True)
    second = (tmp_path / "second").resolve()
    copy = engine_install.relocated(install, second, lambda p: p.is_relative_to(second))
    target = second / "llama.cpp" / built.name
    assert copy == LlamaCppInstall(
        target / "bin" / "llama-server", target / "bin" / "ggml-rpc-server", "build"
    )
    assert ensure_llama_cpp(second, force_build=True) == copy  # cached there now
    assert (target / "bin" / "llama-server").read_text() == "#!/bin/sh\necho fake\n"


def test_copies_are_readable_by_all_and_links_only_where_the_original_is(
    tmp_path: Path,
) -> None:
    source = tmp_path / "pkg"
    (source / "sub").mkdir(parents=True)
    (source / "open.so").write_text("x")
    (source / "open.so").chmod(0o755)
    (source / "sub" / "private.py").write_text("y")
    (source / "sub" / "private.py").chmod(0o600)  # a pip install under umask 077
    (source / "sub").chmod(0o700)
    old = os.umask(0o077)
    try:
        relocate.place_copy(source, tmp_path / "cache" / "pkg", None)
    finally:
        os.umask(old)
    copy = tmp_path / "cache" / "pkg"
    modes = {p.relative_to(copy).as_posix(): p.stat().st_mode & 0o777 for p in copy.rglob("*")}
    assert modes == {"open.so": 0o755, "sub": 0o755, "sub/private.py": 0o644}
    assert (copy / "open.so").stat().st_ino == (source / "open.so").stat().st_ino  # a link
    assert (copy / "sub" / "private.py").stat().st_ino != (
        source / "sub" / "private.py"
    ).stat().st_ino
    assert (source / "sub" / "private.py").stat().st_mode & 0o777 == 0o600  # untouched
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o755


def test_a_portable_copy_without_an_interpreter_the_user_runs_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The venv's interpreter under a private home and no system python3 (>= 3.10)."""
    monkeypatch.setattr(engine_install, "_read_cpu_flags", lambda: cpu_flags(COFFEE_LAKE_AVX2))
    portable = ensure_llama_cpp(tmp_path / "first")
    python = portable.reads[0]
    second = (tmp_path / "second").resolve()
    with pytest.raises(EngineInstallError) as caught:
        engine_install.relocated(
            portable, second, lambda p: p.is_relative_to(second) and p != python
        )
    message = str(caught.value)
    assert str(python) in message and "python3" in message and "LLMGW_LLAMA_CPP=build" in message
