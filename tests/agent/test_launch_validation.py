"""Validation before launch: each rule refuses with a message that says what to change.

GPUs come from the recorded NVML snapshots (tests/fixtures/gpus), so classes and
compute capabilities are the ones real A100 / H100 / L40S nodes report.
"""

import functools

import pytest

from llmgw.types import EngineKind, FabricKind, GpuInfo, LinkLayer, ModelSpec, RdmaPort
from tests.harness import FIXTURES
from worker_agent.engines import (
    EngineProfile,
    LaunchValidationError,
    LoraAdapter,
    NodeFacts,
    Rendezvous,
    launch_problems,
    validate_launch,
)
from worker_agent.gpus import RecordedSource, discover

GPUS = FIXTURES / "gpus"
RDV = Rendezvous(leader_address="10.0.0.1", leader_port=29501, ray_port=6379)


@functools.cache
def gpus(fixture: str) -> tuple[GpuInfo, ...]:
    """A recorded node's GPUs as the agent reports them."""
    return tuple(discover(RecordedSource(GPUS / fixture).snapshot(), ()))


def node(
    n: int,
    fixture: str = "8xH100-SXM.json",
    count: int = 8,
    fabric: FabricKind = FabricKind.INFINIBAND,
) -> NodeFacts:
    chosen = gpus(fixture)[:count]
    layer = LinkLayer.ETHERNET if fabric is FabricKind.ROCE else LinkLayer.INFINIBAND
    ports = () if fabric is FabricKind.NONE else (
        RdmaPort(
            device="mlx5_0", port=1, state="ACTIVE", link_layer=layer, roce_v2_ipv4_gid_index=3
        ),
    )  # fmt: skip
    return NodeFacts(
        host=f"10.0.0.{n}",
        management_interface="eno1",
        fabric=fabric,
        rdma_ports=ports,
        gpu_indices=tuple(g.index for g in chosen),
        gpus=tuple(chosen),
    )


def model(engine: EngineKind = EngineKind.VLLM, *args: str, nodes: int = 1) -> ModelSpec:
    # ``nodes`` lives in the profile; kept as a parameter so call sites read as before.
    del nodes
    return ModelSpec(name="m", engine=engine, source="/models/m", gpus=8, engine_args=list(args))


def test_valid_launches_pass() -> None:
    validate_launch(model(), EngineProfile(tp=8), [node(1)])
    validate_launch(model(nodes=2), EngineProfile(tp=8, pp=2, nodes=2), [node(1), node(2)], RDV)
    validate_launch(
        model(EngineKind.SGLANG, nodes=2), EngineProfile(tp=16, nodes=2), [node(1), node(2)], RDV
    )
    validate_launch(
        model(EngineKind.VLLM), EngineProfile(device="cpu"), [NodeFacts(host="127.0.0.1")]
    )


def test_error_is_a_value_error_carrying_every_problem() -> None:
    with pytest.raises(ValueError, match="tp 4") as info:
        validate_launch(model(nodes=2), EngineProfile(tp=4, nodes=2), [node(1)])
    assert isinstance(info.value, LaunchValidationError)
    assert len(info.value.problems) >= 2  # node count, arithmetic and rendezvous together
    assert any("place exactly profile.nodes" in p for p in info.value.problems)


def test_mixed_gpu_classes_in_one_group() -> None:
    mixed = node(1, "mixed-node.json", count=4)
    found = launch_problems(model(), EngineProfile(tp=4), [mixed])
    assert any("mixed GPU types" in p and "a100-80g" in p and "l40s-45g" in p for p in found)


def test_mixed_gpu_classes_across_nodes() -> None:
    nodes = [node(1, count=4), node(2, "4xL40S.json", count=4)]
    found = launch_problems(model(nodes=2), EngineProfile(tp=4, pp=2, nodes=2), nodes, RDV)
    assert any("h100-80g, l40s-45g" in p for p in found)


def test_nodes_times_gpus_must_equal_tp_times_pp() -> None:
    found = launch_problems(model(nodes=2), EngineProfile(tp=8, nodes=2), [node(1), node(2)], RDV)
    assert found == [
        "2 node(s) x 8 GPU(s) = 16 GPUs, but tp 8 x pp 1 = 8: "
        "make nodes x GPUs per node equal tp x pp"
    ]


def test_uneven_gpus_per_node() -> None:
    nodes = [node(1, count=4), node(2, count=2)]
    found = launch_problems(model(nodes=2), EngineProfile(tp=6, nodes=2), nodes, RDV)
    assert found == ["every node needs the same number of GPUs, got 10.0.0.1=4, 10.0.0.2=2"]


def test_fp8_refused_on_a100() -> None:
    a100 = node(1, "8xA100-40GB.json")
    with pytest.raises(LaunchValidationError) as info:
        validate_launch(model(), EngineProfile(tp=8, quantization="fp8"), [a100])
    assert info.value.problems == [
        "fp8 needs compute capability ≥ 8.9 (Ada/Hopper); these GPUs are 8.0 (A100): "
        "use bf16 or an int8/awq quantisation"
    ]


@pytest.mark.parametrize(
    "args", [("--quantization", "fp8"), ("--quantization=fp8",), ("-q", "fp8")]
)
def test_fp8_in_engine_args_is_seen(args: tuple[str, ...]) -> None:
    found = launch_problems(
        model(EngineKind.VLLM, *args), EngineProfile(tp=8), [node(1, "8xA100-40GB.json")]
    )
    assert any(p.startswith("fp8 needs compute capability") for p in found)


@pytest.mark.parametrize("fixture", ["8xH100-SXM.json", "4xL40S.json"])
def test_fp8_allowed_from_8_9(fixture: str) -> None:
    n = node(1, fixture, count=4)
    assert launch_problems(model(), EngineProfile(tp=4, quantization="fp8"), [n]) == []


def test_multi_node_needs_a_fabric_or_an_opt_in() -> None:
    nodes = [node(1, fabric=FabricKind.NONE), node(2, fabric=FabricKind.NONE)]
    found = launch_problems(model(nodes=2), EngineProfile(tp=8, pp=2, nodes=2), nodes, RDV)
    assert len(found) == 2 and all("no InfiniBand/RoCE fabric" in p for p in found)
    assert all("allow_tcp" in p for p in found)
    assert (
        launch_problems(
            model(nodes=2), EngineProfile(tp=8, pp=2, nodes=2, allow_tcp=True), nodes, RDV
        )
        == []
    )


def test_nodes_on_different_fabrics() -> None:
    nodes = [node(1), node(2, fabric=FabricKind.ROCE)]
    found = launch_problems(model(nodes=2), EngineProfile(tp=8, pp=2, nodes=2), nodes, RDV)
    assert found == [
        "nodes are on different fabrics (infiniband, roce): place the replica in one island"
    ]


def test_multi_node_needs_a_rendezvous() -> None:
    found = launch_problems(model(nodes=2), EngineProfile(tp=8, pp=2, nodes=2), [node(1), node(2)])
    assert found == ["a multi-node replica needs a rendezvous (leader address and port)"]
    ray = EngineProfile(tp=8, pp=2, nodes=2, launch_mode="ray")
    no_head = RDV.model_copy(update={"ray_port": None})
    assert any(
        "ray_port" in p for p in launch_problems(model(nodes=2), ray, [node(1), node(2)], no_head)
    )


def test_llama_multi_node_only_through_rpc() -> None:
    cpu = [NodeFacts(host="10.0.0.1"), NodeFacts(host="10.0.0.2")]
    llama = model(EngineKind.LLAMA_CPP, nodes=2)
    found = launch_problems(llama, EngineProfile(nodes=2), cpu, Rendezvous())
    assert found == [
        "llama.cpp spans nodes only through its RPC backend: give the rendezvous one "
        "ggml-rpc-server host:port per worker rank (1), got 0"
    ]
    rpc = Rendezvous(rpc_workers=("10.0.0.2:50052",))
    # RPC is llama.cpp's own transport: no fabric needed.
    assert launch_problems(llama, EngineProfile(nodes=2), cpu, rpc) == []
    wrong = Rendezvous(rpc_workers=("10.0.0.9:50052",))
    assert launch_problems(llama, EngineProfile(nodes=2), cpu, wrong) == [
        "RPC worker 1 is listed as 10.0.0.9:50052 but runs on 10.0.0.2"
    ]


def test_llama_rpc_worker_must_not_listen_everywhere() -> None:
    nodes = [NodeFacts(host="10.0.0.1"), NodeFacts(host="0.0.0.0", advertise_address="10.0.0.2")]
    rdv = Rendezvous(rpc_workers=("10.0.0.2:50052",))
    found = launch_problems(
        model(EngineKind.LLAMA_CPP, nodes=2), EngineProfile(nodes=2), nodes, rdv
    )
    assert any("no authentication" in p and "10.0.0.2" in p for p in found)


def test_llama_rejects_tp_precision_and_bad_lora_paths() -> None:
    profile = EngineProfile(tp=2, quantization="q4")
    loras = [LoraAdapter(name="x", path="/a,b.gguf")]
    found = launch_problems(model(EngineKind.LLAMA_CPP), profile, [node(1, count=2)], None, loras)
    assert len(found) == 3
    assert "set tp 1 and pp 1" in found[0] and "GGUF" in found[1] and "--lora-scaled" in found[2]


def test_sglang_and_vllm_need_gpus() -> None:
    cpu = [NodeFacts(host="10.0.0.1")]
    (sg,) = launch_problems(model(EngineKind.SGLANG), EngineProfile(), cpu)
    assert sg.startswith("sglang needs GPUs but node(s) 10.0.0.1 have none")
    (vl,) = launch_problems(model(EngineKind.VLLM), EngineProfile(), cpu)
    assert "vLLM runs on CPU only when the profile says device: cpu" in vl
    (sgcpu,) = launch_problems(model(EngineKind.SGLANG), EngineProfile(device="cpu"), cpu)
    assert "SGLang runs on CUDA GPUs only" in sgcpu


def test_cpu_profile_with_gpus_allocated() -> None:
    found = launch_problems(model(), EngineProfile(device="cpu"), [node(1, count=1)])
    assert found == ["the profile says device cpu but GPUs were allocated: place it without"]


def test_ray_is_vllm_only() -> None:
    found = launch_problems(
        model(EngineKind.SGLANG), EngineProfile(tp=8, launch_mode="ray"), [node(1)]
    )
    assert found == ["launch_mode ray is for vLLM only; sglang uses its own launch"]


def test_key_in_engine_args_is_refused() -> None:
    found = launch_problems(
        model(EngineKind.VLLM, "--api-key", "x"), EngineProfile(tp=8), [node(1)]
    )
    assert len(found) == 1 and "remove it from engine_args" in found[0]


def test_gpu_facts_are_required_for_gpu_launches() -> None:
    bare = node(1).model_copy(update={"gpus": ()})
    found = launch_problems(model(), EngineProfile(tp=8), [bare])
    assert found[0].startswith("node 10.0.0.1: pass the GpuInfo of GPUs [0, 1, 2, 3, 4, 5, 6, 7]")


def test_sglang_lora_refused() -> None:
    found = launch_problems(
        model(EngineKind.SGLANG),
        EngineProfile(tp=8),
        [node(1)],
        None,
        [LoraAdapter(name="a", path="/a")],
    )
    assert found == ["LoRA adapters are not wired up for SGLang in llmgw: use vLLM"]
