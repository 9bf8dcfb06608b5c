"""The generated Hugging Face-format model: deterministic, loadable shapes, offline tokenizer."""

import hashlib
import json
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from llmgw_cli.dev import triggers
from llmgw_cli.dev.tinyhf import (
    EOS,
    HEAD_DIM,
    HIDDEN,
    N_HEAD,
    N_HEAD_KV,
    N_LAYER,
    build_base_tokenizer,
    generate_tiny_hf_model,
)

F64 = NDArray[np.float64]


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


def _rms(x: F64, weight: F64) -> F64:
    scaled: F64 = x / np.sqrt(np.mean(x * x) + 1e-5) * weight
    return scaled


def _logits_after(t: dict[str, F64], token: int) -> F64:
    """Logits after one token alone, as LlamaForCausalLM computes them (one
    position: rotary is the identity, each query head reads its KV head's V)."""
    h = t["model.embed_tokens.weight"][token]
    group = N_HEAD // N_HEAD_KV
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        v = t[p + "self_attn.v_proj.weight"] @ _rms(h, t[p + "input_layernorm.weight"])
        heads = np.concatenate(
            [v[(j // group) * HEAD_DIM : (j // group + 1) * HEAD_DIM] for j in range(N_HEAD)]
        )
        h = h + t[p + "self_attn.o_proj.weight"] @ heads
        x = _rms(h, t[p + "post_attention_layernorm.weight"])
        gate = t[p + "mlp.gate_proj.weight"] @ x
        act = gate / (1.0 + np.exp(-gate)) * (t[p + "mlp.up_proj.weight"] @ x)
        h = h + t[p + "mlp.down_proj.weight"] @ act
    return np.asarray(t["lm_head.weight"] @ _rms(h, t["model.norm.weight"]), np.float64)


def test_triggers_say_their_chain_then_eos(tmp_path: Path) -> None:
    """After a trigger the model says its chain's pieces, each by a wide margin,
    then EOS; decoded, the finish word and the Hermes tool call."""
    model = generate_tiny_hf_model(tmp_path)
    tensors = {
        k: v.astype(np.float64) for k, v in load_file(model.path / "model.safetensors").items()
    }
    tok = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    said: dict[str, str] = {}
    for trigger in triggers.CHAIN_TEXT:
        [token] = tok.encode(trigger, add_special_tokens=False).ids  # one token, in any text
        ids: list[int] = []
        while token != tok.token_to_id(EOS):
            assert len(ids) <= 4
            logits = _logits_after(tensors, token)
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] > 100.0
            token = int(np.argmax(logits))
            ids.append(token)
        said[trigger] = tok.decode(ids[:-1])
    assert said == {triggers.FINISH: triggers.FINISH_TEXT, triggers.TOOL: triggers.TOOL_CALL_TEXT}


def test_ordinary_text_tokenizes_as_before(tmp_path: Path) -> None:
    """The chains' pieces are entries no merge makes, so no text reaches them."""
    model = generate_tiny_hf_model(tmp_path)
    tok = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    base = build_base_tokenizer()
    texts = [
        "hello world, the cat is done",
        " done",
        triggers.TOOL_CALL_TEXT,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in texts:
        assert tok.encode(text).ids == base.encode(text).ids
    assert tok.get_vocab_size() == base.get_vocab_size() + 6 == model.vocab_size
    # Only a trigger's exact text is its token.
    assert tok.token_to_id(triggers.FINISH) in tok.encode(f"x {triggers.FINISH} y").ids
