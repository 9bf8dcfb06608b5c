"""A real multi-node replica on this machine: two agents with different node
ids on loopback; rank 1 runs ggml-rpc-server, rank 0 llama-server --rpc.

Every llama.cpp install the agent can choose is tried (``llama_path``). The
portable (AVX2) install has no RPC server: there a multi-node llama.cpp
replica is refused at placement, each node named with the reason, and
nothing starts. It is refused rather than made to work because the portable
package ships no ggml RPC backend for either side (the server's ``--rpc``
or ``ggml-rpc-server``); one-node replicas are what that install serves.
"""

import asyncio
import os
import signal

import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.errors import EngineError
from llmgw.types import (
    EngineCapability,
    EngineKind,
    EngineProfile,
    ModelSpec,
    ReplicaPhase,
    ReplicaTimeouts,
    RestartPolicy,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.conftest import LlamaPath
from tests.harness import System, wait_routable
from tests.procs_util import pids_with_args

MODEL = "tiny-two-nodes"
# An RPC worker's command line (not a source build's, whose cmake and make
# lines name the ggml-rpc-server target too; argv[0] may carry a title).
RPC_WORKER = ("ggml-rpc-server", " -H ", " -p ")


async def test_two_node_llama_cpp_replica_serves_fails_whole_and_restarts(
    system: System, client: Client, tiny: TinyModel, llama_path: LlamaPath
) -> None:
    spec = ModelSpec(
        name=MODEL,
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        profile=EngineProfile(nodes=2),
    )
    key = system.catalog(spec)
    started = await system.start(
        client, "mn-a", "mn-b", own_ports=True, agent_env=llama_path.agent_env()
    )
    if llama_path.install.rpc_server is None:
        await _refused_at_placement(client, spec)
        return

    restart = RestartPolicy(initial_backoff_s=0.5)
    status = await replicas.apply_deployment(client, spec, 1, restart=restart)
    rid = await _slot_replica(client, starts=1)
    await replicas.wait_ready(client, rid, 120)
    rpc_workers = pids_with_args(*RPC_WORKER)
    leaders = pids_with_args("--alias", MODEL, "--rpc")
    assert len(rpc_workers) == 1 and len(leaders) == 1
    snapshot = await replicas.fleet_snapshot(client)
    placed = snapshot.allocations[rid]
    assert {placed.node_id, placed.workers[0].node_id} == {"mn-a", "mn-b"}

    base = started.base
    await wait_routable(base, key, MODEL)
    async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as oai:
        resp = await oai.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert resp.usage is not None and resp.usage.completion_tokens == 4

    # Losing a worker loses the replica: it fails whole, and the deployment
    # starts a new one in its place; nothing of the first attempt is left.
    os.kill(rpc_workers[0], signal.SIGKILL)
    new_rid = await _slot_replica(client, starts=2)
    failed = await replicas.status_of(client, rid)
    assert failed is not None and failed.phase is ReplicaPhase.FAILED
    assert "rank 1" in failed.reason
    await replicas.wait_ready(client, new_rid, 120)
    assert not set(rpc_workers + leaders) & set(
        pids_with_args(*RPC_WORKER) + pids_with_args("--alias", MODEL)
    )
    assert len(pids_with_args(*RPC_WORKER)) == 1
    assert rid not in (await replicas.fleet_snapshot(client)).allocations
    status = await replicas.deployment_status(client, MODEL)
    assert "rank 1" in status.slots[0].last_reason

    # Scaling to zero drains the replica; the deployment then ends.
    final = await replicas.remove_deployment(client, spec, 60)
    assert final.desired == 0
    assert pids_with_args("--alias", MODEL) == []
    assert pids_with_args(*RPC_WORKER) == []


async def _refused_at_placement(client: Client, spec: ModelSpec) -> None:
    """Without an RPC server on the nodes the replica is never placed: the
    reason names each node and what it lacks, and no engine starts."""
    snapshot = await replicas.fleet_snapshot(client)
    for node_id in ("mn-a", "mn-b"):
        assert snapshot.nodes[node_id].capabilities == []
    timeouts = ReplicaTimeouts(place_attempts=2, place_retry_s=0.5)
    rid = await replicas.start_replica(client, spec, timeouts)
    with pytest.raises(EngineError) as failed:
        await replicas.wait_ready(client, rid, 60)
    status = await replicas.status_of(client, rid)
    assert status is not None and status.phase is ReplicaPhase.FAILED
    lacks = f"no RPC server (capability {EngineCapability.LLAMA_CPP_RPC.value})"
    for node_id in ("mn-a", "mn-b"):
        assert f"{node_id}: its llama.cpp install has {lacks}" in status.reason
    assert "cannot place" in str(failed.value)
    assert pids_with_args("--alias", MODEL) == []
    assert pids_with_args(*RPC_WORKER) == []


async def _slot_replica(client: Client, starts: int) -> str:
    """The replica of slot 0 once the deployment has started it ``starts`` times."""
    async with asyncio.timeout(60):
        while True:
            status = await replicas.deployment_status(client, MODEL)
            if status.slots and status.slots[0].starts == starts:
                return status.slots[0].replica_id
            await asyncio.sleep(0.1)


async def test_rendezvous_that_never_completes_fails_within_its_bound(
    system: System, client: Client, tiny: TinyModel
) -> None:
    spec = ModelSpec(
        name="tiny-never-meets",
        engine=EngineKind.LLAMA_CPP,
        source=str(tiny.model_path),
        profile=EngineProfile(nodes=2),
    )
    system.spawn("control")
    # Rank 0 lands on the node whose id sorts last (placement is deterministic).
    system.spawn_agent("rv-b")
    worker_agent = system.spawn("agent", {"LLMGW_NODE_ID": "rv-a"})
    await replicas.wait_node_registered(client, "rv-a", 60)
    await replicas.wait_node_registered(client, "rv-b", 60)
    nodes = (await replicas.fleet_snapshot(client)).nodes
    if EngineCapability.LLAMA_CPP_RPC not in (nodes["rv-a"].capabilities or []):
        pytest.skip(
            "this machine's llama.cpp has no RPC server: a two-node replica is refused at "
            "placement (test_two_node_llama_cpp_replica_serves_fails_whole_and_restarts)"
        )
    worker_agent.signal(signal.SIGSTOP)  # the worker's node stops answering
    try:
        timeouts = ReplicaTimeouts(rendezvous_s=6, schedule_to_start_s=8, heartbeat_s=2)
        rid = await replicas.start_replica(client, spec, timeouts)
        with pytest.raises(EngineError) as failed:
            await replicas.wait_ready(client, rid, 90)
        assert "not complete within 6s" in str(failed.value)
        status = await replicas.status_of(client, rid)
        assert status is not None and status.phase is ReplicaPhase.FAILED
        assert rid not in (await replicas.fleet_snapshot(client)).allocations
        assert pids_with_args("--alias", "tiny-never-meets") == []
        assert pids_with_args(*RPC_WORKER) == []
    finally:
        worker_agent.signal(signal.SIGCONT)
