"""The catalog file: what it accepts, and errors that name the field."""

import pytest

from llmgw.catalog import parse_catalog
from llmgw.errors import ConfigError
from llmgw.types import EngineKind

GOOD = """
models:
  - name: tiny
    engine: llama.cpp
    source: /srv/tiny.gguf
    replicas: 2
  - name: big
    engine: vllm
    source: /srv/big
    gpus: 8
    profile: {tp: 8, nodes: 2, launch_mode: ray}
"""


def test_a_good_file() -> None:
    tiny, big = parse_catalog(GOOD)
    assert (tiny.name, tiny.replicas, tiny.engine) == ("tiny", 2, EngineKind.LLAMA_CPP)
    assert big.spec().profile.nodes == 2 and big.spec().profile.launch_mode == "ray"
    assert "replicas" not in big.spec().model_dump()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("replicas: 2", "replicass: 2"), "models[0].replicass: Extra inputs"),
        (GOOD.replace("tp: 8", "tp: 0"), "models[1].profile.tp: Input should be greater"),
        (GOOD.replace("engine: vllm", "engine: trt"), "models[1].engine: Input should be"),
        (GOOD.replace("name: big", "name: tiny"), "duplicate names tiny"),
        ("models: [", "not valid YAML"),
        ("{}", "models: Field required"),
    ],
)
def test_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_catalog(text)
    assert message in str(err.value)


def test_adapter_names_share_the_model_namespace() -> None:
    text = """
models:
  - name: base
    source: /m.gguf
    adapters: [{name: sql, source: /a/sql.gguf}, {name: base, source: /a/x.gguf}]
  - name: other
    source: /o.gguf
    adapters: [{name: sql, source: /a/sql2.gguf}]
"""
    with pytest.raises(ConfigError) as err:
        parse_catalog(text)
    assert "models[0].adapters[1].name: 'base' is also a model's name" in str(err.value)
    assert "models[1].adapters[0].name: 'sql' is already an adapter of base" in str(err.value)


def test_runtime_lora_is_vllm_only() -> None:
    text = "models: [{name: m, source: /m.gguf, profile: {runtime_lora: true}}]"
    with pytest.raises(ConfigError, match=r"models\[0\].profile.runtime_lora: only vLLM"):
        parse_catalog(text)
