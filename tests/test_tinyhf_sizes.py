"""The HF model's sizes: the tests' tiny one byte for byte as pinned (for an
ordinary prompt, as before), and the prefix bench's (``--size bench``) as
docs/benchmarks.md describes it."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from llmgw_cli.dev.tinyhf import BENCH, TINY, build_base_tokenizer, generate_tiny_hf_model, main

# The tiny model's files, the chains' tokens in (issue 34): any change is on purpose.
TINY_SHA256 = {
    "config.json": "ad534aaa12114e991515fda5daf4d46a9ec82531d863633dd7af8bf0ccf96e67",
    "tokenizer_config.json": "1896f852df965313f324d79459a5c02b2abb0995a6a0d15ede5e3e1f8841c57c",
    "model.safetensors": "fea7771f56f0aa2f403ec8f424de4b97544314e0ff2af6a805b6888fa67b6d0d",
    "tokenizer.json": "bef20c64db62a930d0e154ca429f49ba82a2dc154f325e99c627d3e425fba29c",
}
# What an ordinary prompt's tokens and output depend on, as generated before sizes
# and chains existed (commit 736f48f): the base tokenizer's file, and every weight
# but the chains' rows and EOS's output row (suppressed at an ordinary position,
# before and after). The vLLM tests' model must not change for them.
BASE_TOKENIZER_SHA256 = "55a33685d6467520c08136684cce2302f3ce673f045d3af7fd0fa0163ebaf46e"
BASE_WEIGHTS_SHA256 = "3b0790815771c41d0e2e6977c99734c48e82c2f356ba0a94fd084b0eaa14a390"


def test_the_tiny_model_is_byte_for_byte_the_pinned_one(tmp_path: Path) -> None:
    model = generate_tiny_hf_model(tmp_path)
    got = {
        name: hashlib.sha256((model.path / name).read_bytes()).hexdigest() for name in TINY_SHA256
    }
    assert got == TINY_SHA256


def _base_weights_digest(path: Path, n_base: int) -> str:
    tensors = load_file(path)
    digest = hashlib.sha256()
    for name in sorted(tensors):
        w = tensors[name]
        if name == "model.embed_tokens.weight":
            w = w[:n_base]
        elif name == "lm_head.weight":
            w = np.delete(w[:n_base], 2, axis=0)
        digest.update(name.encode() + np.ascontiguousarray(w, np.float32).tobytes())
    return digest.hexdigest()


def test_ordinary_prompts_see_the_old_model(tmp_path: Path) -> None:
    model = generate_tiny_hf_model(tmp_path)
    base = build_base_tokenizer()
    text = base.to_str(pretty=True) + "\n"
    assert hashlib.sha256(text.encode()).hexdigest() == BASE_TOKENIZER_SHA256
    n_base = base.get_vocab_size()
    assert _base_weights_digest(model.path / "model.safetensors", n_base) == BASE_WEIGHTS_SHA256
    assert load_file(model.path / "model.safetensors")["lm_head.weight"][2, 0] < -10000


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
