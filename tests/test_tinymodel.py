"""Tests for llmgw_cli.dev.tinymodel: the synthetic GGUF model the end-to-end tests serve.

No server here: the files are read back with gguf.GGUFReader, and a numpy forward
pass over the first position (where RoPE is the identity and attention just copies V)
checks that the adapters change the greedy token and that only words can be sampled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from numpy.typing import NDArray

from llmgw_cli.dev import tinymodel, triggers
from llmgw_cli.dev.tinymodel import TinyModel, generate_tiny_model

F64 = NDArray[np.float64]
SPACE = "\u2581"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return generate_tiny_model(tmp_path_factory.mktemp("tiny"))


def _files(t: TinyModel) -> list[Path]:
    return [t.model_path, *t.adapters.values()]


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"missing GGUF key {key}"
    return field.contents()


def _tensors(path: Path) -> dict[str, F64]:
    """Tensors in numpy order, i.e. (n_out, n_in): GGUF ne order reversed."""
    reader = gguf.GGUFReader(path)
    return {t.name: np.array(t.data, dtype=np.float64) for t in reader.tensors}


def _shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    """Tensor shapes in GGUF ne order, (n_in, n_out) for matrices."""
    return {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}


def _tokens(path: Path) -> list[str]:
    tokens = _field(gguf.GGUFReader(path), "tokenizer.ggml.tokens")
    assert isinstance(tokens, list)
    return [str(t) for t in tokens]


def test_api_shape(tiny: TinyModel) -> None:
    assert tiny.model_path.name.endswith(".gguf")
    assert set(tiny.adapters) == {"lora-a", "lora-b"}
    for path in _files(tiny):
        assert path.is_file()
        assert path.parent == tiny.model_path.parent


def test_deterministic_across_dirs(tiny: TinyModel, tmp_path: Path) -> None:
    other = generate_tiny_model(tmp_path / "nested" / "again")
    for a, b in zip(_files(tiny), _files(other), strict=True):
        assert a.name == b.name
        assert a.read_bytes() == b.read_bytes()
    assert tiny.adapters["lora-a"].read_bytes() != tiny.adapters["lora-b"].read_bytes()


def test_idempotent_leaves_files_untouched(tmp_path: Path) -> None:
    first = generate_tiny_model(tmp_path)
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in _files(first)}
    second = generate_tiny_model(tmp_path)
    assert second == first
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in _files(second)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in before)


def test_repairs_corrupted_file(tmp_path: Path) -> None:
    tiny = generate_tiny_model(tmp_path)
    good = hashlib.sha256(tiny.adapters["lora-b"].read_bytes()).hexdigest()
    tiny.adapters["lora-b"].write_bytes(b"truncated")
    tiny.model_path.unlink()
    generate_tiny_model(tmp_path)
    assert hashlib.sha256(tiny.adapters["lora-b"].read_bytes()).hexdigest() == good
    assert tiny.model_path.stat().st_size > 400_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files


def test_sizes(tiny: TinyModel) -> None:
    assert 400_000 <= tiny.model_path.stat().st_size <= 800_000
    for path in tiny.adapters.values():
        assert 20_000 <= path.stat().st_size <= 40_000


def test_model_metadata(tiny: TinyModel) -> None:
    r = gguf.GGUFReader(tiny.model_path)
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "general.file_type") == gguf.LlamaFileType.ALL_F32
    assert _field(r, "llama.block_count") == 2
    assert _field(r, "llama.embedding_length") == 64
    assert _field(r, "llama.feed_forward_length") == 128
    assert _field(r, "llama.attention.head_count") == 4
    assert _field(r, "llama.attention.head_count_kv") == 2
    assert _field(r, "llama.rope.dimension_count") == 16
    assert _field(r, "tokenizer.ggml.model") == "llama"
    assert (_field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id")) == (
        1,
        2,
    )
    template = _field(r, "tokenizer.chat_template")
    assert "<|im_start|>" in template and "add_generation_prompt" in template


def test_vocab_layout(tiny: TinyModel) -> None:
    r = gguf.GGUFReader(tiny.model_path)
    tokens = _tokens(tiny.model_path)
    types = [int(t) for t in _field(r, "tokenizer.ggml.token_type")]
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert types[3:259] == [gguf.TokenType.BYTE] * 256
    assert len(set(tokens)) == len(tokens)
    assert len(_field(r, "tokenizer.ggml.scores")) == len(tokens)
    assert _field(r, "llama.vocab_size") == len(tokens)
    n_base = _n_base(tokens)
    pieces = tokens[259:n_base]
    assert {SPACE + "the", SPACE + "hello", "a", "Z", "!"} <= set(pieces)
    assert all(types[i] == gguf.TokenType.NORMAL for i in range(259, n_base))
    # The chains' tokens come last: the triggers user-defined (split out of any text).
    assert tokens[n_base : n_base + 2] == [triggers.FINISH, triggers.TOOL]
    assert types[n_base : n_base + 2] == [gguf.TokenType.USER_DEFINED] * 2
    assert all(types[i] == gguf.TokenType.NORMAL for i in range(n_base + 2, len(tokens)))


def test_tensor_shapes(tiny: TinyModel) -> None:
    reader = gguf.GGUFReader(tiny.model_path)
    n_vocab = len(_tokens(tiny.model_path))
    # GGUF ne order: (n_in, n_out), the reverse of numpy.
    expected = {
        "token_embd.weight": (64, n_vocab),
        "output.weight": (64, n_vocab),
        "output_norm.weight": (64,),
    }
    for i in range(2):
        expected |= {
            f"blk.{i}.attn_norm.weight": (64,),
            f"blk.{i}.attn_q.weight": (64, 64),
            f"blk.{i}.attn_k.weight": (64, 32),
            f"blk.{i}.attn_v.weight": (64, 32),
            f"blk.{i}.attn_output.weight": (64, 64),
            f"blk.{i}.ffn_norm.weight": (64,),
            f"blk.{i}.ffn_gate.weight": (64, 128),
            f"blk.{i}.ffn_up.weight": (64, 128),
            f"blk.{i}.ffn_down.weight": (128, 64),
        }
    assert _shapes(reader) == expected
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}


@pytest.mark.parametrize("name", ["lora-a", "lora-b"])
def test_adapter_metadata_and_shapes(tiny: TinyModel, name: str) -> None:
    reader = gguf.GGUFReader(tiny.adapters[name])
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.type") == "adapter"
    assert _field(reader, "adapter.type") == "lora"
    assert _field(reader, "adapter.lora.alpha") == pytest.approx(tinymodel.LORA_ALPHA)
    model = _shapes(gguf.GGUFReader(tiny.model_path))
    shapes = _shapes(reader)
    assert len(shapes) == 2 * 2 * 4  # layers x {a, b} x {q, k, v, output}
    for i in range(2):
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            n_in, n_out = model[f"blk.{i}.{proj}.weight"]
            # What llama.cpp checks: a is ne [n_in, r], b is ne [r, n_out].
            assert shapes.pop(f"blk.{i}.{proj}.weight.lora_a") == (n_in, 8)
            assert shapes.pop(f"blk.{i}.{proj}.weight.lora_b") == (8, n_out)
    assert shapes == {}


def _n_base(tokens: list[str]) -> int:
    """The vocabulary before the chains' tokens (the first of them is a trigger)."""
    return tokens.index(triggers.FINISH)


def _emittable(tokens: list[str]) -> NDArray[np.bool_]:
    """Words an ordinary context may sample: the chains' tokens are not among them."""
    n_base = _n_base(tokens)
    return np.array(
        [i < n_base and t.startswith(SPACE) and len(t) > 2 for i, t in enumerate(tokens)]
    )


def test_only_words_are_sampleable(tiny: TinyModel) -> None:
    """The constant residual dimension and its output weights never let a byte,
    control token or stray character win, and every winner is printable ASCII."""
    tokens = _tokens(tiny.model_path)
    w = _tensors(tiny.model_path)
    a = _tensors(tiny.adapters["lora-a"])
    allowed = _emittable(tokens)
    assert allowed.sum() > 100
    assert all(tokens[i][1:].isascii() and tokens[i][1:].isalpha() for i in np.flatnonzero(allowed))
    n_base = _n_base(tokens)
    assert np.all(w["token_embd.weight"][:n_base, 0] == 1.0)
    assert np.all(w["output.weight"][allowed, 0] == 0.0)
    assert np.all(w["output.weight"][~allowed, 0] <= -100.0)
    for i in range(2):
        assert not w[f"blk.{i}.attn_output.weight"][0].any()
        assert not w[f"blk.{i}.ffn_down.weight"][0].any()
        assert not a[f"blk.{i}.attn_output.weight.lora_b"][0].any()


def _rms(x: F64, weight: F64) -> F64:
    scaled: F64 = x / np.sqrt(np.mean(x * x) + 1e-5) * weight
    return scaled


def _first_logits(
    model: dict[str, F64], adapter: dict[str, F64] | None, scale: float, token: int = 1
) -> F64:
    """Logits after one token (<s> unless told) alone, as llama.cpp computes them
    (W + scale * B @ A)."""

    def weight(name: str) -> F64:
        w = model[name]
        if adapter is not None and f"{name}.lora_a" in adapter:
            w = w + scale * adapter[f"{name}.lora_b"] @ adapter[f"{name}.lora_a"]
        return w

    h = model["token_embd.weight"][token]
    for i in range(2):
        x = _rms(h, model[f"blk.{i}.attn_norm.weight"])
        v = weight(f"blk.{i}.attn_v.weight") @ x
        # One position: softmax is 1, so each query head reads its KV head's V.
        heads = np.concatenate([v[(j // 2) * 16 : (j // 2 + 1) * 16] for j in range(4)])
        h = h + weight(f"blk.{i}.attn_output.weight") @ heads
        x = _rms(h, model[f"blk.{i}.ffn_norm.weight"])
        gate = weight(f"blk.{i}.ffn_gate.weight") @ x
        act = gate / (1.0 + np.exp(-gate)) * (weight(f"blk.{i}.ffn_up.weight") @ x)
        h = h + weight(f"blk.{i}.ffn_down.weight") @ act
    return np.asarray(model["output.weight"] @ _rms(h, model["output_norm.weight"]), np.float64)


def test_adapters_change_greedy_token(tiny: TinyModel) -> None:
    model = _tensors(tiny.model_path)
    allowed = _emittable(_tokens(tiny.model_path))
    scale = tinymodel.LORA_ALPHA / tinymodel.LORA_RANK
    logits = {
        "base": _first_logits(model, None, scale),
        **{n: _first_logits(model, _tensors(p), scale) for n, p in tiny.adapters.items()},
    }
    winners = {name: int(np.argmax(lg)) for name, lg in logits.items()}
    assert len(set(winners.values())) == 3, winners
    for lg in logits.values():
        assert allowed[int(np.argmax(lg))]
        assert lg[~allowed].max() < lg[allowed].max() - 50.0
        # A margin well above float noise, so CPU and GPU backends agree on the winner.
        top2 = np.sort(lg)[-2:]
        assert top2[1] - top2[0] > 0.01


def test_main_prints_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tinymodel.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / tinymodel.MODEL_FILE) in out
    assert "lora-a" in out and "lora-b" in out
    assert tinymodel.main([]) == 2


def _base_digest(path: Path) -> str:
    """What an ordinary prompt's output depends on: every weight but the chains' rows
    and EOS's output row (suppressed at an ordinary position, before and after)."""
    tensors = _tensors(path)
    n_base = _n_base(_tokens(path))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        w = tensors[name]
        if name == "token_embd.weight":
            w = w[:n_base]
        elif name == "output.weight":
            w = np.delete(w[:n_base], 2, axis=0)
        digest.update(name.encode() + np.ascontiguousarray(w, np.float32).tobytes())
    return digest.hexdigest()


# The model's weights before the chains existed (commit 27ab2bc), as _base_digest sees
# them: the chains changed no ordinary prompt's output. Recompute only on purpose.
BASE_DIGEST = "38b5df5b2fa2cdd8d0731a94fb2a6903c14b255b56572ae24f311d75afa8b5aa"


def test_chains_leave_ordinary_weights_alone(tiny: TinyModel) -> None:
    assert _base_digest(tiny.model_path) == BASE_DIGEST
    w = _tensors(tiny.model_path)
    # EOS is as suppressed at an ordinary position as it was (the bias is +1 there).
    assert w["output.weight"][2, 0] <= tinymodel._SUPPRESS


@pytest.mark.parametrize("adapter", [None, "lora-a", "lora-b"])
def test_triggers_say_their_chain_then_eos(tiny: TinyModel, adapter: str | None) -> None:
    """After a trigger the model says its chain's pieces, each by a wide margin, then EOS."""
    model = _tensors(tiny.model_path)
    lora = None if adapter is None else _tensors(tiny.adapters[adapter])
    tokens = _tokens(tiny.model_path)
    scale = tinymodel.LORA_ALPHA / tinymodel.LORA_RANK
    for trigger, chain in tinymodel.CHAINS.items():
        token = tokens.index(trigger)
        for piece in chain:
            logits = _first_logits(model, lora, scale, token)
            top2 = np.sort(logits)[-2:]
            assert int(np.argmax(logits)) == tokens.index(piece), (trigger, piece)
            assert top2[1] - top2[0] > 100.0
            token = tokens.index(piece)
    said = "".join(tinymodel.CHAINS[triggers.FINISH][:-1]).replace(SPACE, " ")
    assert said == triggers.FINISH_TEXT
    said = "".join(tinymodel.CHAINS[triggers.TOOL][:-1]).replace(SPACE, " ")
    assert said == triggers.TOOL_CALL_TEXT


def _formed(text: str, vocab: set[str]) -> bool:
    """Whether llama.cpp's SPM merger can form ``text`` as one symbol: a single
    character, or two formable vocabulary pieces whose concatenation it is."""
    if len(text) == 1:
        return True
    return any(
        text[:i] in vocab
        and text[i:] in vocab
        and _formed(text[:i], vocab)
        and _formed(text[i:], vocab)
        for i in range(1, len(text))
    )


def test_no_text_tokenizes_to_a_chain_piece(tiny: TinyModel) -> None:
    """So no prompt's tokens changed when the pieces joined the vocabulary."""
    tokens = _tokens(tiny.model_path)
    vocab = set(tokens)
    for piece in tokens[_n_base(tokens) + 2 :]:
        assert not _formed(piece, vocab), piece
    assert _formed(SPACE + "the", vocab)  # the check finds what is formed


def _render(messages: list[dict[str, Any]]) -> str:
    import jinja2  # noqa: PLC0415

    template = jinja2.Environment(autoescape=False).from_string(triggers.CHAT_TEMPLATE)
    return template.render(messages=messages, add_generation_prompt=True)


def test_template_is_plain_chatml_without_a_trigger() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello <tool_call> done"},
        {"role": "assistant", "content": "the cat"},
        {"role": "user", "content": "more"},
    ]
    chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert _render(messages) == chatml + "<|im_start|>assistant\n"


def test_template_ends_with_the_last_message_trigger() -> None:
    call: dict[str, Any] = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    turn: list[dict[str, Any]] = [
        {"role": "user", "content": f"look it up {triggers.TOOL}"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    asked = _render(turn[:1])
    assert asked.endswith(f"<|im_start|>assistant\n{triggers.TOOL}")
    answered = _render([*turn, {"role": "tool", "content": f"42 {triggers.FINISH}"}])
    said = answered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert said.startswith("<tool_call>\n") and said.endswith("\n</tool_call>")
    assert json.loads(said[len("<tool_call>\n") : -len("\n</tool_call>")]) == call["function"]
    assert answered.endswith(f"<|im_start|>assistant\n{triggers.FINISH}")
