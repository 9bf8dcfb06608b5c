"""What an agent reports beyond its hardware: engine capabilities and its weights roots."""

import os
from pathlib import Path

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


def test_weights_report_lists_the_roots_with_what_the_agent_would_refuse(tmp_path: Path) -> None:
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
    by_path = {e.path.removeprefix(real): e for e in report.entries}
    assert sorted(by_path) == [
        "/escape.gguf", "/gone.gguf", "/org", "/org/hf-model", "/org/hf-model/config.json",
        "/secret.gguf", "/tiny.gguf",
    ]  # fmt: skip
    assert by_path["/tiny.gguf"].problem == ""
    assert by_path["/org/hf-model"].kind == "dir" and by_path["/org/hf-model"].listed
    assert "outside the weights roots" in by_path["/escape.gguf"].problem
    assert "which is gone" in by_path["/gone.gguf"].problem
    assert by_path["/secret.gguf"].problem == "not readable by the agent"


def test_weights_report_is_bounded(tmp_path: Path) -> None:
    root = tmp_path / "models"
    deep = root / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "m.gguf").write_bytes(b"GGUF")
    for i in range(10):
        (root / f"m{i}.gguf").write_bytes(b"GGUF")
    report = weights_report([root], depth=3)
    paths = [e.path.removeprefix(str(root.resolve())) for e in report.entries]
    assert "/a/b/c" in paths and "/a/b/c/d" not in paths  # three levels
    assert next(e for e in report.entries if e.path.endswith("/a/b/c")).listed is False
    capped = weights_report([root], limit=5)
    assert len(capped.entries) == 5 and not capped.complete
