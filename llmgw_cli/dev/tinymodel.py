"""A tiny, deterministic llama GGUF model and two LoRA adapters, generated on demand.

Why this exists: the gateway's end-to-end tests must drive a *real* llama.cpp server
(``llama-server``) - load a model, apply chat templates, stream tokens, switch LoRA
adapters per request - without downloading gigabytes of weights or needing a GPU.
So we synthesise the smallest model llama.cpp accepts as a normal llama checkpoint:

* llama architecture, 2 layers, hidden 64, 4 query / 2 KV heads, FFN 128, all F32
  (about 0.6 MB), with weights drawn from ``numpy.random.default_rng`` with fixed seeds,
  so every run writes byte-identical files (for given numpy and gguf versions; if those
  ever change the bytes, the hash check below simply rewrites the files);
* a SentencePiece ("llama") vocabulary: ``<unk> <s> </s>``, the 256 byte-fallback
  tokens, then printable pieces, so any prompt tokenizes;
* a chatml chat template, which llama.cpp knows both natively and through jinja;
* two rank-8 LoRA adapters on the attention projections ("lora-a", "lora-b").

Random weights would happily emit byte and control tokens (invalid UTF-8 fragments,
early EOS). To keep output readable, one residual dimension (``_BIAS_DIM``) is held at
a constant value: every token embedding sets it, no layer writes to it, and the output
matrix has a large negative weight on it for every token that must never be sampled.
Only whole-word pieces ("▁the" -> " the") survive, so greedy output is printable ASCII
and generation always runs to ``max_tokens``.

A client that needs an answer to end (an agent framework that treats ``length`` as a
failure) puts a *trigger* in the last message: the model then answers a word and
stops, or calls a tool and stops (llmgw_cli/dev/triggers.py). A prompt without a
trigger generates what it always did.

Run ``python -m llmgw_cli.dev.tinymodel OUT_DIR`` to write the files and print their paths.

The same recipe with larger dimensions (:data:`BENCH`, ``--size bench``) writes a
bigger random-weight model for benchmarks whose point is the prompt's prefill (the
prefix-cache routing bench): the tiny model's prefill is so cheap that a cached
prompt saves nothing measurable. Its figures, with one llama.cpp thread, are in
:data:`BENCH`'s comment. The tiny model's bytes do not depend on it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gguf
import numpy as np
from numpy.typing import NDArray

from llmgw_cli.dev.triggers import CHAIN_TEXT, CHAT_TEMPLATE, append_chain_rows, chain_tokens

F32 = NDArray[np.float32]

MODEL_FILE = "tiny-llama.gguf"
ADAPTER_FILES = {"lora-a": "tiny-lora-a.gguf", "lora-b": "tiny-lora-b.gguf"}
# One seed per file: each adapter differs from the other and from the base.
_MODEL_SEED = 20240601
_ADAPTER_SEEDS = {"lora-a": 1, "lora-b": 2}

N_LAYER = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
N_CTX = 2048
LORA_RANK = 8
# llama.cpp scales B @ A by alpha / rank = 2. Together with B's spread this makes the
# adapters move greedy output (not merely nudge logits) without blowing up the residual
# stream, which would shrink the suppression margin below.
LORA_ALPHA = 16.0
_LORA_B_STD = 0.2
# The four attention projections get adapters: (name, rows of W = n_out).
LORA_TARGETS = (
    ("attn_q", N_HEAD * HEAD_DIM),
    ("attn_k", N_HEAD_KV * HEAD_DIM),
    ("attn_v", N_HEAD_KV * HEAD_DIM),
    ("attn_output", N_EMBD),
)

_BIAS_DIM = 0  # residual dimension that stays constant through every layer
_BIAS_VALUE = 1.0
_SUPPRESS = -10000.0  # output weight on _BIAS_DIM for tokens that must never be sampled
_SPACE = "\u2581"  # SentencePiece's visible space

# The triggers and what they make the model say (llmgw_cli/dev/triggers.py), here as
# SentencePiece spells it; the triggers are user-defined tokens, so llama.cpp splits
# them out of any text, and no text tokenizes to a chain's piece: the SPM merger only
# joins two pieces whose concatenation is in the vocabulary, and no split of these into
# two pieces it can form is (tests/test_tinymodel.py checks it).
EOS = "</s>"
SPELL = {text: text.replace(" ", _SPACE) for chain in CHAIN_TEXT.values() for text in chain}
CHAINS: dict[str, tuple[str, ...]] = {
    trigger: (*(SPELL[text] for text in chain), EOS) for trigger, chain in CHAIN_TEXT.items()
}

# Whole words are the only pieces the model ever emits (see _build_vocab).
_WORD_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good me "
    "give our under name very through just form sentence great think say help low line cat dog "
    "tree sky blue red green light model token hello world yes small fast slow open close river "
    "stone cloud"
)
_WORDS = tuple(_WORD_TEXT.split())
_SUFFIXES = ("ing", "ed", "er", "ly", "es", "s", "tion", "th", "he", "in", "an", "re", "on")


@dataclass(frozen=True)
class Dims:
    """A model's shape, and what makes its weights: the seed and its name."""

    name: str
    file: str
    seed: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


TINY = Dims(
    name="llmgw tiny test model",
    file=MODEL_FILE,
    seed=_MODEL_SEED,
    n_layer=N_LAYER,
    n_embd=N_EMBD,
    n_head=N_HEAD,
    n_head_kv=N_HEAD_KV,
    n_ff=N_FF,
    n_ctx=N_CTX,
)
# For tests/bench/bench_prefix.py: 4 layers, hidden 256, 8 query / 4 KV heads, FFN 768,
# F32 (13.7 MB). On the 2-core AVX-512 dev VM, one thread, the wheel's llama-server:
# a ~1,030-token prompt's prefill took 199-278 ms (timings.prompt_ms) and one decoded
# token 5.6 ms (predicted_per_token_ms), 36-50x; 2x128 and 4x128 were as lopsided but
# their prefill (40-120 ms) too close to a loaded router's own milliseconds, 6x384
# too slow for four replicas on two cores. Its KV cache is 2 KiB per token (F16), so
# llama.cpp's default 8 GiB host prompt cache (--cache-ram) holds ~4M of its tokens.
BENCH = Dims(
    name="llmgw prefill bench model",
    file="bench-llama.gguf",
    seed=20261206,
    n_layer=4,
    n_embd=256,
    n_head=8,
    n_head_kv=4,
    n_ff=768,
    n_ctx=16384,  # four slots of W2's ~2,100-token prompts, and room
)
SIZES = {"tiny": TINY, "bench": BENCH}


@dataclass(frozen=True)
class TinyModel:
    model_path: Path
    adapters: dict[str, Path]


@dataclass(frozen=True)
class _Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    emittable: NDArray[np.bool_]  # tokens the model may sample (chains' aside)
    n_base: int  # the vocabulary before the chains' tokens, which follow it

    def id(self, piece: str) -> int:
        return self.tokens.index(piece)


def _build_vocab() -> _Vocab:
    """Specials, byte fallback, then pieces; only whole words are ever sampled. The
    chains' tokens come last, so every earlier token keeps its id and its weights."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    # Single characters let any ASCII text tokenize without byte fallback; words and
    # suffixes give the SPM merger something to merge. dict.fromkeys dedupes in order.
    singles = [_SPACE] + [chr(c) for c in range(33, 127)]
    words = [_SPACE + w for w in _WORDS] + [_SPACE + chr(c) for c in range(97, 123)]
    pieces = list(dict.fromkeys(singles + list(_SUFFIXES) + words))
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # SPM merges the adjacent pair whose merged piece scores highest; prefer long pieces.
    scores = [0.0] * (3 + 256) + [float(len(p)) - 100.0 for p in pieces]
    emittable = np.array([t.startswith(_SPACE) and len(t) > 2 for t in tokens])
    n_base = len(tokens)
    chain = chain_tokens(SPELL)
    tokens += chain
    types += [gguf.TokenType.USER_DEFINED if p in CHAINS else gguf.TokenType.NORMAL for p in chain]
    scores += [-1000.0] * len(chain)
    emittable = np.concatenate([emittable, np.zeros(len(chain), dtype=np.bool_)])
    return _Vocab(tokens, scores, [int(t) for t in types], emittable, n_base)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> F32:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _layer_tensors(rng: np.random.Generator, i: int, d: Dims = TINY) -> dict[str, F32]:
    """One transformer block; numpy shapes are (n_out, n_in), GGUF stores them reversed."""
    kv = d.n_head_kv * d.head_dim
    inv = 1.0 / np.sqrt(d.n_embd)
    t = {
        "attn_norm": np.ones(d.n_embd, dtype=np.float32),
        "attn_q": _normal(rng, (d.n_head * d.head_dim, d.n_embd), 2.0 * inv),
        "attn_k": _normal(rng, (kv, d.n_embd), 2.0 * inv),
        "attn_v": _normal(rng, (kv, d.n_embd), inv),
        "attn_output": _normal(rng, (d.n_embd, d.n_head * d.head_dim), inv),
        "ffn_norm": np.ones(d.n_embd, dtype=np.float32),
        "ffn_gate": _normal(rng, (d.n_ff, d.n_embd), inv),
        "ffn_up": _normal(rng, (d.n_ff, d.n_embd), inv),
        "ffn_down": _normal(rng, (d.n_embd, d.n_ff), 1.0 / np.sqrt(d.n_ff)),
    }
    # Blocks add their outputs to the residual; keeping these rows zero keeps the
    # suppression dimension at exactly _BIAS_VALUE.
    t["attn_output"][_BIAS_DIM, :] = 0.0
    t["ffn_down"][_BIAS_DIM, :] = 0.0
    return {f"blk.{i}.{name}.weight": w for name, w in t.items()}


def _model_tensors(vocab: _Vocab, d: Dims = TINY) -> dict[str, F32]:
    rng = np.random.default_rng(d.seed)
    # Drawn for the base vocabulary alone, in the order they always were, so every
    # base token's weights and every later draw are what they were before the chains.
    embd = _normal(rng, (vocab.n_base, d.n_embd), 1.0)
    embd[:, _BIAS_DIM] = _BIAS_VALUE
    out = _normal(rng, (vocab.n_base, d.n_embd), 1.0 / np.sqrt(d.n_embd))
    out[:, _BIAS_DIM] = np.where(vocab.emittable[: vocab.n_base], 0.0, _SUPPRESS)
    ids = {t: vocab.n_base + i for i, t in enumerate(vocab.tokens[vocab.n_base :])}
    embd, out = append_chain_rows(embd, out, ids, SPELL, vocab.id(EOS), _BIAS_DIM, _SUPPRESS)
    tensors = {"token_embd.weight": embd}
    for i in range(d.n_layer):
        tensors.update(_layer_tensors(rng, i, d))
    tensors["output_norm.weight"] = np.ones(d.n_embd, dtype=np.float32)
    tensors["output.weight"] = out
    return tensors


def _adapter_tensors(seed: int) -> dict[str, F32]:
    """lora_a is (r, n_in) and lora_b is (n_out, r) in numpy order, i.e. GGUF ne
    [n_in, r] and [r, n_out]: llama.cpp computes W x + scale * B (A x)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, F32] = {}
    for i in range(N_LAYER):
        for name, n_out in LORA_TARGETS:
            a = _normal(rng, (LORA_RANK, N_EMBD), 1.0 / np.sqrt(N_EMBD))
            b = _normal(rng, (n_out, LORA_RANK), _LORA_B_STD)
            if name == "attn_output":
                b[_BIAS_DIM, :] = 0.0  # never disturb the suppression dimension
            tensors[f"blk.{i}.{name}.weight.lora_a"] = a
            tensors[f"blk.{i}.{name}.weight.lora_b"] = b
    return tensors


def _model_metadata(w: gguf.GGUFWriter, vocab: _Vocab, d: Dims = TINY) -> None:
    w.add_name(d.name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(len(vocab.tokens))
    w.add_context_length(d.n_ctx)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_rope_dimension_count(d.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def _adapter_metadata(w: gguf.GGUFWriter, name: str) -> None:
    w.add_name(f"llmgw tiny {name}")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, LORA_ALPHA)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_gguf(
    target: Path, metadata: Callable[[gguf.GGUFWriter], None], tensors: dict[str, F32]
) -> None:
    """Write to a temp file beside target, then os.replace it in - unless target already
    holds exactly these bytes, in which case it is left untouched (same inode, same
    mtime), so a server that has the file mmapped or a concurrent writer never sees a
    partial or changing file."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, "llama")
        metadata(writer)
        for name, tensor in tensors.items():
            writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if target.is_file() and _sha256(target) == _sha256(tmp):
            return
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        tmp.chmod(0o644)  # mkstemp creates 0600; servers may run as another user
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def generate_tiny_model(out_dir: Path) -> TinyModel:
    """Write (idempotently, atomically: temp file + os.replace) the model and adapters
    into out_dir; if files already exist with the expected content hash, do nothing."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _build_vocab()
    model_path = out_dir / MODEL_FILE
    _write_gguf(model_path, partial(_model_metadata, vocab=vocab), _model_tensors(vocab))
    adapters: dict[str, Path] = {}
    for name, filename in ADAPTER_FILES.items():
        path = out_dir / filename
        tensors = _adapter_tensors(_ADAPTER_SEEDS[name])
        _write_gguf(path, partial(_adapter_metadata, name=name), tensors)
        adapters[name] = path
    return TinyModel(model_path=model_path, adapters=adapters)


def generate_model(out_dir: Path, dims: Dims) -> Path:
    """Write (as generate_tiny_model does: idempotent, atomic) the base model of
    ``dims`` alone, no adapters, into out_dir; its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _build_vocab()
    path = out_dir / dims.file
    _write_gguf(path, partial(_model_metadata, vocab=vocab, d=dims), _model_tensors(vocab, dims))
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    size = "tiny"
    if len(args) == 3 and args[0] == "--size" and args[1] in SIZES:
        size, args = args[1], args[2:]
    if len(args) != 1:
        print(
            f"usage: python -m llmgw_cli.dev.tinymodel [--size {'|'.join(SIZES)}] OUT_DIR",
            file=sys.stderr,
        )
        return 2
    if size != "tiny":
        print(f"model {generate_model(Path(args[0]), SIZES[size])}")
        return 0
    tiny = generate_tiny_model(Path(args[0]))
    print(f"model {tiny.model_path}")
    for name, path in tiny.adapters.items():
        print(f"{name} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
