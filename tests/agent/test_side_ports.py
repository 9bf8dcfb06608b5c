"""Multi-node side ports (ggml RPC, Ray, the engines' rendezvous) never bind or
advertise a wildcard address: refused when the plan is built on the agent,
and before anything starts by the control plane's validation."""

import pytest

from llmgw.types import EngineKind, EngineProfile, FabricKind, ModelSpec, Rendezvous
from worker_agent.engines import (
    LaunchValidationError,
    NodeFacts,
    ShardRequest,
    launch_problems,
    plan_shard,
)
from worker_agent.engines.base import WILDCARD_ADDRESSES

# (engine, launch_mode): every way llmgw spans nodes.
MULTI_NODE = [
    (EngineKind.LLAMA_CPP, "mp"),
    (EngineKind.VLLM, "mp"),
    (EngineKind.VLLM, "ray"),
    (EngineKind.SGLANG, "mp"),
]


def node(n: int, host: str = "") -> NodeFacts:
    """Node ``n`` at 10.0.0.n (or bound to ``host``), two GPUs, plain TCP."""
    return NodeFacts(
        host=host or f"10.0.0.{n}",
        advertise_address=host or f"10.0.0.{n}",
        management_interface="eth0",
        http_port=8000 + n,
        fabric=FabricKind.NONE,
        gpu_indices=(0, 1),
    )


def rendezvous(engine: EngineKind, leader: str = "10.0.0.1") -> Rendezvous:
    if engine is EngineKind.LLAMA_CPP:
        return Rendezvous(rpc_workers=("10.0.0.2:50052",), timeout_s=60)
    return Rendezvous(leader_address=leader, leader_port=29501, ray_port=6379, timeout_s=60)


def model(engine: EngineKind, launch_mode: str) -> ModelSpec:
    nodes = {"nodes": 2, "allow_tcp": True, "launch_mode": launch_mode}
    parallel = {} if engine is EngineKind.LLAMA_CPP else {"tp": 4}
    return ModelSpec(
        name="m",
        engine=engine,
        source="/models/m",
        gpus=0 if engine is EngineKind.LLAMA_CPP else 2,
        profile=EngineProfile.model_validate({**nodes, **parallel}),
    )


def request(
    engine: EngineKind, launch_mode: str, rank: int, facts: NodeFacts, rdv: Rendezvous
) -> ShardRequest:
    spec = model(engine, launch_mode)
    return ShardRequest(model=spec, profile=spec.profile, rank=rank, node=facts, rendezvous=rdv)


@pytest.mark.parametrize(("engine", "mode"), MULTI_NODE)
def test_every_rank_binds_and_advertises_the_node_address(engine: EngineKind, mode: str) -> None:
    rdv = rendezvous(engine)
    for rank in (0, 1):
        plan = plan_shard(request(engine, mode, rank, node(rank + 1), rdv), "k", {})
        words = [a for c in plan.commands for a in c.argv] + list(plan.env.values())
        words += [v for c in plan.commands for v in c.env.values()]
        words += [e.host for c in plan.commands for e in c.wait_for]
        assert not any(w in WILDCARD_ADDRESSES - {""} or "0.0.0.0" in w for w in words), words
    worker = plan_shard(request(engine, mode, 1, node(2), rdv), "k", {})
    # The worker's own side port names its own address.
    assert "10.0.0.2" in [a for c in worker.commands for a in c.argv] + [
        worker.env.get("VLLM_HOST_IP", "")
    ]


@pytest.mark.parametrize(("engine", "mode"), MULTI_NODE)
@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_node_address_is_refused(engine: EngineKind, mode: str, wildcard: str) -> None:
    rdv = rendezvous(engine)
    worker = request(engine, mode, 1, node(2, host=wildcard), rdv)
    if engine is not EngineKind.SGLANG:  # SGLang's plan takes the address as given...
        with pytest.raises(LaunchValidationError, match="private"):
            plan_shard(worker, "k", {})
    # ...and validation, before anything starts, refuses it for every engine.
    found = launch_problems(worker.model, worker.profile, [node(1), node(2, host=wildcard)], rdv)
    assert any("no authentication" in p and "every address" in p for p in found), found


@pytest.mark.parametrize(
    ("engine", "mode"), [m for m in MULTI_NODE if m[0] is not EngineKind.LLAMA_CPP]
)
def test_a_wildcard_leader_address_is_refused(engine: EngineKind, mode: str) -> None:
    rdv = rendezvous(engine, leader="0.0.0.0")
    with pytest.raises(LaunchValidationError, match="private"):
        plan_shard(request(engine, mode, 1, node(2), rdv), "k", {})
    spec = model(engine, mode)
    found = launch_problems(spec, spec.profile, [node(1), node(2)], rdv)
    assert any("leader address is 0.0.0.0" in p for p in found), found
