"""The HF model's sizes: the tests' tiny one byte for byte as before, and the
prefix bench's (``--size bench``) as docs/benchmarks.md describes it."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from llmgw_cli.dev.tinyhf import BENCH, TINY, generate_tiny_hf_model, main

# The tiny model's files as generated before sizes existed (commit 736f48f):
# the vLLM tests' model must not change with them.
TINY_SHA256 = {
    "config.json": "0a0aaf53bed3043df87b9b5448e53fb327dbe5e3ce12906ce31a26e8f35d425d",
    "tokenizer_config.json": "536583acb2f3eb1bc8f9663a11b09f83815aa36adfb67b35b035e73037753c04",
    "model.safetensors": "288c892c80d25170cda7274eadf4212e9ca7e6f49d1354459efbc5f743c235f2",
    "tokenizer.json": "55a33685d6467520c08136684cce2302f3ce673f045d3af7fd0fa0163ebaf46e",
}


def test_the_tiny_model_is_byte_for_byte_the_old_one(tmp_path: Path) -> None:
    model = generate_tiny_hf_model(tmp_path)
    got = {
        name: hashlib.sha256((model.path / name).read_bytes()).hexdigest() for name in TINY_SHA256
    }
    assert got == TINY_SHA256


def test_the_bench_size_is_the_documented_one(tmp_path: Path) -> None:
    assert main(["--size", "bench", str(tmp_path / "bench")]) == 0
    config = json.loads((tmp_path / "bench" / "config.json").read_text())
    documented = {
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1536,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in documented} == documented
    tok_config = json.loads((tmp_path / "bench" / "tokenizer_config.json").read_text())
    assert tok_config["model_max_length"] == 4096
    tensors = load_file(tmp_path / "bench" / "model.safetensors")
    assert tensors["model.layers.3.mlp.gate_proj.weight"].shape == (1536, 512)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 64, 512)
    # The same tokenizer as the tiny model's: one word list, one BPE.
    tiny = generate_tiny_hf_model(tmp_path / "tiny")
    assert (tmp_path / "bench" / "tokenizer.json").read_bytes() == (
        tiny.path / "tokenizer.json"
    ).read_bytes()
    assert BENCH.head_dim == 64 and TINY.head_dim == 32


def test_a_head_dim_vllm_cannot_generate_with_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim 16"):
        generate_tiny_hf_model(tmp_path, replace(TINY, n_head=8))
    assert not (tmp_path / "model.safetensors").exists()
