"""What an agent reports beyond its hardware: engine capabilities and its weights roots."""

import os
from pathlib import Path

from llmgw.path_filter import OPAQUE, PathFilter
from llmgw.types import EngineCapability
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.inventory import engine_capabilities, weights_report


def test_the_rpc_server_is_a_capability_the_portable_install_lacks(tmp_path: Path) -> None:
    server = tmp_path / "llama-server"
    wheel = LlamaCppInstall(server=server, rpc_server=tmp_path / "rpc", source="wheel")
    portable = LlamaCppInstall(server=server, rpc_server=None, source="portable")
    assert engine_capabilities(wheel) == [EngineCapability.LLAMA_CPP_RPC]
    assert engine_capabilities(portable) == []
    assert engine_capabilities(None) == []


def test_weights_report_names_the_roots_what_is_there_and_what_the_agent_refuses(
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    (root / "org" / "hf-model").mkdir(parents=True)
    (root / "org" / "hf-model" / "config.json").write_text("{}")
    (root / "tiny.gguf").write_bytes(b"GGUF")
    (root / "secret.gguf").write_bytes(b"GGUF")
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(b"GGUF")
    (root / "escape.gguf").symlink_to(outside)
    (root / "gone.gguf").symlink_to(tmp_path / "nothing")
    unreadable = str((root / "secret.gguf").resolve())

    def access(path: str, mode: int) -> bool:
        return path != unreadable and os.access(path, mode)

    report = weights_report([root], access=access)
    real = str(root.resolve())
    assert report.roots == [real] and report.complete
    refused = {e.path.removeprefix(real): e.problem for e in report.refused}
    assert sorted(refused) == ["/escape.gguf", "/gone.gguf", "/secret.gguf"]
    assert "outside the weights roots" in refused["/escape.gguf"]
    assert "which is gone" in refused["/gone.gguf"]
    assert refused["/secret.gguf"] == "not readable by the agent"
    found = PathFilter.decode(report.found, report.found_bits)
    for path in ("/tiny.gguf", "/org", "/org/hf-model", "/org/hf-model/config.json"):
        assert real + path in found
    assert real + "/missing.gguf" not in found


def test_weights_report_is_bounded_in_size_and_depth(tmp_path: Path) -> None:
    root = tmp_path / "models"
    deep = root / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "m.gguf").write_bytes(b"GGUF")
    for i in range(2000):
        (root / f"m{i:04}.gguf").write_bytes(b"")
    report = weights_report([root], depth=3)
    real = str(root.resolve())
    found = PathFilter.decode(report.found, report.found_bits)
    assert real + "/a/b/c" in found and OPAQUE + real + "/a/b/c" in found  # not walked
    assert not report.complete  # 2,000 files past the limit
    assert len(report.model_dump_json()) < 4096  # whatever the roots hold
