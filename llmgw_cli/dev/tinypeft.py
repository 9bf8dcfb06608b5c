"""Tiny PEFT LoRA adapters for the generated HF model (llmgw_cli/dev/tinyhf.py).

vLLM loads PEFT adapters: an ``adapter_config.json`` and an
``adapter_model.safetensors`` whose tensors are named after the base model's
modules. Written by hand (no torch, no peft): rank-8 LoRA on every layer's
q and v projections, random, one seed per adapter, so each adapter changes
greedy output differently. Deterministic: the same bytes every run.
"""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save as save_safetensors

from llmgw_cli.dev.tinyhf import HEAD_DIM, HIDDEN, N_HEAD, N_HEAD_KV, N_LAYER, TinyHfModel

RANK = 8
ALPHA = 16
# Large enough that an adapter moves the argmax of a random model.
SCALE = 0.5


def generate_peft_adapter(base: TinyHfModel, out_dir: Path, seed: int) -> Path:
    """Write one adapter into ``out_dir`` (created); returns it."""
    rng = np.random.default_rng(seed)
    outs = {"q_proj": N_HEAD * HEAD_DIM, "v_proj": N_HEAD_KV * HEAD_DIM}
    tensors: dict[str, np.ndarray] = {}
    for layer in range(N_LAYER):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.normal(0.0, SCALE, (RANK, HIDDEN)).astype(np.float32)
            b = rng.normal(0.0, SCALE, (out, RANK)).astype(np.float32)
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base.path),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": sorted(outs),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out_dir / "adapter_model.safetensors").write_bytes(
        save_safetensors(tensors, metadata={"format": "pt"})
    )
    return out_dir
