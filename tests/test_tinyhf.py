"""The generated Hugging Face-format model: deterministic, loadable shapes, offline tokenizer."""

import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from llmgw_cli.dev.tinyhf import EOS, HEAD_DIM, HIDDEN, N_LAYER, generate_tiny_hf_model


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_generation_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    a = generate_tiny_hf_model(tmp_path / "a")
    b = generate_tiny_hf_model(tmp_path / "b")
    assert _digests(a.path) == _digests(b.path)
    before = (a.path / "model.safetensors").stat().st_mtime_ns
    generate_tiny_hf_model(a.path)
    assert (a.path / "model.safetensors").stat().st_mtime_ns == before  # not rewritten


def test_checkpoint_matches_its_config(tmp_path: Path) -> None:
    model = generate_tiny_hf_model(tmp_path)
    config = json.loads((model.path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == HEAD_DIM >= 32
    tensors = load_file(model.path / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].shape == (model.vocab_size, HIDDEN)
    assert tensors["lm_head.weight"].shape == (config["vocab_size"], HIDDEN)
    assert sum(1 for name in tensors if name.endswith("q_proj.weight")) == N_LAYER
    assert all(t.dtype == np.float32 for t in tensors.values())
    tok_config = json.loads((model.path / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tok_config["chat_template"]


def test_tokenizer_round_trips_any_text_offline(tmp_path: Path) -> None:
    model = generate_tiny_hf_model(tmp_path)
    tok = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    text = "hello world, ünïcode & 123"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_end_of_sequence_can_never_be_sampled(tmp_path: Path) -> None:
    model = generate_tiny_hf_model(tmp_path)
    tensors = load_file(model.path / "model.safetensors")
    tok = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    head = tensors["lm_head.weight"]
    # The held-constant residual dimension carries a large negative weight for EOS.
    assert head[tok.token_to_id(EOS), 0] < -1000
    assert head[tok.token_to_id("\u0120the"), 0] == 0.0
