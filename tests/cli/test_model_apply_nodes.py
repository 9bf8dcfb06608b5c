"""`llmgw model apply` refuses what the agents would refuse, naming the field.

A real control worker and agent (its own weights root) on the test Temporal
server, and the real CLI: before, every bad entry here was accepted and
failed only when a replica started (for an autoscaled model, at its first
wake, as a 503 to a client).
"""

import asyncio
import shutil
from pathlib import Path

from temporalio.client import Client

from llmgw import replicas
from llmgw.store import Store
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System


async def test_apply_checks_sources_and_engine_args_against_the_agents(
    system: System, client: Client, tiny: TinyModel, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    root.mkdir()
    model = root / "tiny.gguf"
    shutil.copyfile(tiny.model_path, model)
    (root / "escape.gguf").symlink_to(tiny.model_path)  # a link out of the root
    system.spawn("control")
    system.spawn("agent", {"LLMGW_NODE_ID": "apply-node", "LLMGW_WEIGHTS_ROOTS": str(root)})
    await replicas.wait_node_registered(client, "apply-node", 60)

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "models:\n"
        "  - {name: glob, source: '/x/*.gguf'}\n"
        f"  - {{name: missing, source: {root}/missing.gguf}}\n"
        f"  - {{name: escape, source: {root}/escape.gguf}}\n"
        "  - {name: remote, source: 'modelscope://org/model',"
        " adapters: [{name: a, source: 'hf://org/lora'}]}\n"
    )
    refused = await asyncio.to_thread(system.cli, "model", "apply", str(bad))
    assert refused.returncode == 1, refused.stderr
    said = " ".join(refused.stderr.split())  # rich wraps long lines
    assert "models[0].source: /x/*.gguf cannot be read on any node (node apply-node: " in said
    assert "outside the weights roots" in said
    assert f"models[1].source: {root}/missing.gguf cannot be read on any node " in said
    assert "(node apply-node: does not exist (as reported " in said
    assert f"models[2].source: {root}/escape.gguf cannot be read on any node" in said
    assert f"resolves to {tiny.model_path}, outside the weights roots" in said
    assert "models[3].adapters[0].source: adapters are read from local paths only" in said
    owned = tmp_path / "owned.yaml"
    owned.write_text(
        f"models:\n  - {{name: open, source: {model}, engine_args: [-hf, org/x, '--host=::']}}\n"
    )
    refused = await asyncio.to_thread(system.cli, "model", "apply", str(owned))
    assert refused.returncode == 1, refused.stderr
    said = " ".join(refused.stderr.split())
    assert "models[0].engine_args: -hf downloads" in said
    assert "models[0].engine_args: --host sets where the engine listens" in said
    store = Store(system.store_url)
    try:
        store.migrate()
        assert store.model_names() == []  # nothing was written
    finally:
        store.close()

    good = tmp_path / "good.yaml"
    good.write_text(
        f"models:\n  - name: tiny-scaled\n    source: {model}\n"
        "    autoscale: {min_replicas: 0, max_replicas: 2}\n"
    )
    applied = await asyncio.to_thread(system.cli, "model", "apply", str(good))
    assert applied.returncode == 0, applied.stderr
    assert "model tiny-scaled: llama.cpp, autoscale 0..2 replicas" in applied.stderr
    assert "1 replicas" not in applied.stderr
