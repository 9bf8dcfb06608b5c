"""engine_args may not set what llmgw sets: the model, address, key, adapters, downloads.

Each refusal names the flag (and the owned flag an abbreviation stands for),
in every form the engine's parser reads: short aliases, ``--flag=value``,
argparse abbreviations, vLLM's underscores and dotted JSON fields, and vLLM
serve's positional model. The control plane (launch_problems) and the agent
(plan_shard, whoever asked) refuse alike.
"""

import pytest

from llmgw.catalog import CatalogModel, parse_catalog, problems_with
from llmgw.engine_flags import owned_flag_problems
from llmgw.errors import ConfigError
from llmgw.types import EngineKind, ModelSpec
from worker_agent.engines import (
    EngineProfile,
    LaunchValidationError,
    NodeFacts,
    ShardRequest,
    launch_problems,
    plan_shard,
)

LLAMA, VLLM, SGLANG = EngineKind.LLAMA_CPP, EngineKind.VLLM, EngineKind.SGLANG


@pytest.mark.parametrize(
    ("engine", "args", "named"),
    [
        # The escapes, llama.cpp.
        (LLAMA, ["--model", "/etc/shadow"], "--model"),
        (LLAMA, ["-m", "/anywhere.gguf"], "-m"),
        (LLAMA, ["--model=/anywhere.gguf"], "--model"),
        (LLAMA, ["-hf", "org/repo:Q4_K_M"], "-hf"),
        (LLAMA, ["-hfr", "org/repo"], "-hfr"),
        (LLAMA, ["--hf-repo=org/repo"], "--hf-repo"),
        (LLAMA, ["-hff", "x.gguf"], "-hff"),
        (LLAMA, ["-mu", "https://example.com/m.gguf"], "-mu"),
        (LLAMA, ["--model-url", "https://example.com/m.gguf"], "--model-url"),
        (LLAMA, ["--lora", "/tmp/evil.gguf"], "--lora"),
        (LLAMA, ["--lora-scaled", "/tmp/evil.gguf:1"], "--lora-scaled"),
        (LLAMA, ["--host", "0.0.0.0"], "--host"),
        (LLAMA, ["--port", "80"], "--port"),
        (LLAMA, ["--api-key", "k"], "--api-key"),
        (LLAMA, ["--api-key-file", "/tmp/k"], "--api-key-file"),
        (LLAMA, ["--rpc", "10.0.0.9:50052"], "--rpc"),
        (LLAMA, ["--tools", "all"], "--tools"),
        (LLAMA, ["--media-path", "/"], "--media-path"),
        (LLAMA, ["-a", "other-model"], "-a"),
        # vLLM: names, =, abbreviations, underscores, dotted fields, positionals.
        (VLLM, ["--model", "/anywhere"], "--model"),
        (VLLM, ["--model=/anywhere"], "--model"),
        (VLLM, ["--host", "0.0.0.0"], "--host"),
        (VLLM, ["--ho", "0.0.0.0"], "--ho (read as --host)"),
        (VLLM, ["--port=80"], "--port"),
        (VLLM, ["--api_key", "k"], "--api_key (read as --api-key)"),
        (VLLM, ["--lora-modules", "a=/tmp/a"], "--lora-modules"),
        (VLLM, ["--lora-mod", "a=/tmp/a"], "--lora-mod (read as --lora-modules)"),
        (VLLM, ["--download-dir", "/tmp/hf"], "--download-dir"),
        (VLLM, ["--download_dir=/tmp/hf"], "--download_dir (read as --download-dir)"),
        (VLLM, ["--config", "/tmp/args.yaml"], "--config"),
        (VLLM, ["--speculative-config.model", "org/draft"], "--speculative-config.model"),
        (VLLM, ["--uds", "/tmp/s.sock"], "--uds"),
        (VLLM, ["gpt2"], "'gpt2' is a positional argument"),
        (VLLM, ["--enforce-eager=true", "org/model"], "'org/model' is a positional"),
        # A switch takes no value: the word after it is a positional (the model).
        (VLLM, ["--enforce-eager", "/anywhere"], "'/anywhere' is a positional"),
        (VLLM, ["--trust-remote-code", "gpt2"], "'gpt2' is a positional"),
        (VLLM, ["--enforce_eager", "/anywhere"], "'/anywhere' is a positional"),
        (VLLM, ["--reasoning-parser-plugin", "/tmp/p.py"], "--reasoning-parser-plugin"),
        (VLLM, ["--logits-processors", "mod:Cls"], "--logits-processors"),
        (VLLM, ["--worker-extension-cls", "mod.Cls"], "--worker-extension-cls"),
        (VLLM, ["--kv-transfer-config", "{}"], "--kv-transfer-config"),
        (VLLM, ["--kv-events-config={}"], "--kv-events-config"),
        (VLLM, ["--otlp-traces-endpoint", "h:4317"], "--otlp-traces-endpoint"),
        (VLLM, ["--generation-config", "/elsewhere"], "--generation-config"),
        (VLLM, ["--chat-template", "/etc/shadow"], "--chat-template"),
        # SGLang.
        (SGLANG, ["--model-path", "/anywhere"], "--model-path"),
        (SGLANG, ["--model", "/anywhere"], "--model"),
        (SGLANG, ["--model-p=/anywhere"], "--model-p (read as --model-path)"),
        (SGLANG, ["--host=0.0.0.0"], "--host"),
        (SGLANG, ["--port", "80"], "--port"),
        (SGLANG, ["--api-key", "k"], "--api-key"),
        (SGLANG, ["--lora-paths", "a=/tmp/a"], "--lora-paths"),
        (SGLANG, ["--download-dir", "/tmp/hf"], "--download-dir"),
        (SGLANG, ["--tokenizer-path", "/elsewhere"], "--tokenizer-path"),
        (SGLANG, ["--tool-server", "http://x"], "--tool-server"),
        (SGLANG, ["--custom-weight-loader", "mod.fn"], "--custom-weight-loader"),
        (SGLANG, ["--chat-template=/etc/shadow"], "--chat-template"),
    ],
)
def test_owned_flags_are_refused_naming_the_flag(
    engine: EngineKind, args: list[str], named: str
) -> None:
    (problem,) = owned_flag_problems(engine, args)
    assert problem.startswith(f"engine_args: {named}"), problem
    assert "engine_args" in problem


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        (LLAMA, ["--parallel", "1", "--metrics"]),
        (LLAMA, ["--embeddings", "--pooling", "mean"]),
        (LLAMA, ["-t", "1", "--ctx-size", "128", "--seed", "-1"]),
        (VLLM, ["--enforce-eager"]),
        (VLLM, ["--max-num-seqs", "8", "--dtype=bfloat16", "--seed", "-1"]),
        (VLLM, ["--tokenizer-mode", "auto", "--hf-overrides.max_position_embeddings", "64"]),
        (VLLM, ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]),
        (VLLM, ["--enforce-eager", "--max_num_seqs", "8", "--some-new-option=value"]),
        (SGLANG, ["--mem-fraction-static", "0.8", "--tokenizer-mode", "slow"]),
    ],
)
def test_ordinary_engine_args_pass(engine: EngineKind, args: list[str]) -> None:
    assert owned_flag_problems(engine, args) == []


def test_every_problem_is_named_at_once_and_profile_args_too() -> None:
    spec = ModelSpec(
        name="m",
        source="/models/m.gguf",
        engine_args=["--host", "0.0.0.0", "-hf", "org/x"],
        profile=EngineProfile(engine_args=("--lora", "/x.gguf")),
    )
    found = launch_problems(spec, spec.profile, [NodeFacts(host="127.0.0.1")])
    assert [p.split(" ", 2)[:2] for p in found] == [
        ["engine_args:", "--host"],
        ["engine_args:", "-hf"],
        ["profile.engine_args:", "--lora"],
    ]


def test_the_agent_refuses_them_whoever_asked() -> None:
    """plan_shard is the agent's: a launch that skipped the control plane's
    validation (any Temporal writer can start one) is refused there too."""
    spec = ModelSpec(name="m", source="/models/m.gguf", engine_args=["--host=0.0.0.0"])
    request = ShardRequest(model=spec, node=NodeFacts(host="127.0.0.1", http_port=8080))
    with pytest.raises(LaunchValidationError, match="engine_args: --host"):
        plan_shard(request, key="k", base_env={})


def test_the_catalog_refuses_them_when_an_entry_is_written() -> None:
    """Where entries are written (the catalog file, the admin API's
    problems_with): refused there, before anything is stored."""
    text = (
        "models:\n  - name: ok\n    source: /m/a.gguf\n    engine_args: [--parallel, '2']\n"
        "  - name: bad\n    source: /m/b.gguf\n    engine_args: [--model-url, 'https://x/y.gguf']\n"
        "    profile: {engine_args: ['--api-key-file', /k]}\n"
    )
    with pytest.raises(ConfigError) as refused:
        parse_catalog(text)
    assert "models[1].engine_args: --model-url downloads" in str(refused.value)
    assert "models[1].profile.engine_args: --api-key-file sets the engine key" in str(refused.value)
    entry = CatalogModel(name="x", source="/m/x.gguf", engine_args=["--lora", "/elsewhere"])
    (problem,) = problems_with([entry], [], lambda _: "")
    assert problem.startswith("engine_args: --lora loads adapters")
