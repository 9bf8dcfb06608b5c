"""vLLM on Ray through the real Rendezvous workflow on a real Temporal server.

Ray cannot run here, so the commands are data: fake node activities,
registered under the real names on each node's own queue, reserve ports as
an agent would, and on launch build the shard's plan with the real vLLM
adapter from the spec the workflow sent; the fake validation runs the real
launch rules on the nodes' facts, as the control activity does.
"""

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from llmgw import contracts
from llmgw.queues import node_queue
from llmgw.types import (
    EngineKind,
    EngineProfile,
    FabricKind,
    FetchWeightsInput,
    FetchWeightsResult,
    GpuInfo,
    LaunchShardInput,
    ModelSpec,
    NodeFabric,
    NodeInventory,
    Placement,
    PortReservation,
    RendezvousInput,
    ReplicaTimeouts,
    ShardHandle,
    ShardPlacement,
    ShardRef,
    ShardSpec,
    StopShardInput,
    StopShardResult,
    ValidateInput,
    ValidateResult,
    WaitReadyInput,
    WaitReadyResult,
)
from worker_agent.engines import (
    ShardPlan,
    ShardRequest,
    launch_problems,
    node_facts,
    plan_shard,
)
from workflows.rendezvous import RendezvousWorkflow

KEY = "llmgw-engine-ray-test"
HTTP_PORT = 18100  # the leader's engine HTTP port, as the agent would pick it


def inventory(node_id: str, address: str) -> NodeInventory:
    gpus = [
        GpuInfo(
            index=i,
            uuid=f"GPU-{node_id}-{i}",
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            compute_capability="9.0",
            gpu_class="h100-80g",
        )
        for i in range(2)
    ]
    return NodeInventory(
        node_id=node_id,
        hostname=node_id,
        address=address,
        cpu_count=64,
        memory_mib=512 * 1024,
        gpus=gpus,
        fabric=NodeFabric(
            kind=FabricKind.NONE, management_interface="eth0", management_address=address
        ),
    )


@dataclass
class FakeNode:
    """One agent's node activities: ports reserved, specs launched, plans built."""

    inv: NodeInventory
    next_port: int
    reserved: dict[int, int] = field(default_factory=dict)
    specs: list[ShardSpec] = field(default_factory=list)
    plans: dict[int, ShardPlan] = field(default_factory=dict)
    stops: int = 0

    @activity.defn(name=contracts.RESERVE_PORT.name)
    async def reserve_port(self, ref: ShardRef) -> PortReservation:
        port = self.reserved.setdefault(ref.rank, self.next_port)  # idempotent, as the agent
        return PortReservation(host=self.inv.address, port=port)

    @activity.defn(name=contracts.FETCH_WEIGHTS.name)
    async def fetch(self, req: FetchWeightsInput) -> FetchWeightsResult:
        return FetchWeightsResult(path=req.source, sha256="0" * 64, size_bytes=1, cached=True)

    @activity.defn(name=contracts.LAUNCH_SHARD.name)
    async def launch(self, req: LaunchShardInput) -> ShardHandle:
        spec = req.spec
        self.specs.append(spec)
        facts = node_facts(self.inv, spec.gpu_indices, HTTP_PORT, host=self.inv.address)
        request = ShardRequest(
            model=spec.model,
            profile=spec.model.profile,
            rank=spec.rank,
            node=facts,
            rendezvous=spec.rendezvous,
        )
        self.plans[spec.rank] = plan_shard(request, KEY, {"PATH": "/usr/bin"})
        return ShardHandle(
            replica_id=spec.replica_id,
            rank=spec.rank,
            pid=1000 + spec.rank,
            port=HTTP_PORT,
            endpoint=f"http://{self.inv.address}:{HTTP_PORT}",
        )

    @activity.defn(name=contracts.WAIT_SHARD_READY.name)
    async def wait_ready(self, req: WaitReadyInput) -> WaitReadyResult:
        return WaitReadyResult(model_ids=["llama-70b"])

    @activity.defn(name=contracts.STOP_SHARD.name)
    async def stop(self, req: StopShardInput) -> StopShardResult:
        self.stops += 1
        return StopShardResult(was_running=False)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.reserve_port, self.fetch, self.launch, self.wait_ready, self.stop]


@dataclass
class FakeControl:
    """``validate_replica`` with the real rules over the fake nodes' facts."""

    nodes: dict[str, NodeInventory]
    seen: list[ValidateInput] = field(default_factory=list)

    @activity.defn(name=contracts.VALIDATE_REPLICA.name)
    async def validate(self, req: ValidateInput) -> ValidateResult:
        self.seen.append(req)
        facts = [
            node_facts(self.nodes[s.node_id], s.gpu_indices, http_port=0)
            for s in req.placement.shards()
        ]
        problems = launch_problems(req.model, req.model.profile, facts, req.rendezvous)
        if problems:  # as the real activity refuses: once, with every reason
            raise ApplicationError(
                "cannot start: " + "; ".join(problems),
                type="LaunchValidationError",
                non_retryable=True,
            )
        return ValidateResult()


@dataclass
class Cluster:
    client: Client
    queue: str
    head: FakeNode
    worker: FakeNode
    control: FakeControl


@pytest.fixture
async def cluster(client: Client) -> AsyncIterator[Cluster]:
    tag = uuid.uuid4().hex[:8]
    head = FakeNode(inventory(f"ray-head-{tag}", "10.1.0.1"), next_port=18500)
    worker = FakeNode(inventory(f"ray-worker-{tag}", "10.1.0.2"), next_port=18600)
    control = FakeControl({n.inv.node_id: n.inv for n in (head, worker)})
    queue = f"control-test-{tag}"
    workers = [
        Worker(
            client,
            task_queue=queue,
            workflows=[RendezvousWorkflow],
            activities=[control.validate],
        ),
        *(
            Worker(client, task_queue=node_queue(n.inv.node_id), activities=n.activities())
            for n in (head, worker)
        ),
    ]
    async with workers[0], workers[1], workers[2]:
        yield Cluster(client, queue, head, worker, control)


async def test_vllm_on_ray_starts_through_the_rendezvous(cluster: Cluster) -> None:
    model = ModelSpec(
        name="llama-70b",
        engine=EngineKind.VLLM,
        source="/models/llama-70b",
        gpus=2,
        profile=EngineProfile(tp=2, pp=2, nodes=2, launch_mode="ray", allow_tcp=True),
    )
    rid = f"ray-{uuid.uuid4().hex[:8]}"
    placement = Placement(
        replica_id=rid,
        model=model.name,
        node_id=cluster.head.inv.node_id,
        gpu_indices=[0, 1],
        workers=[ShardPlacement(rank=1, node_id=cluster.worker.inv.node_id, gpu_indices=[0, 1])],
    )
    result = await cluster.client.execute_workflow(
        RendezvousWorkflow.run,
        RendezvousInput(
            replica_id=rid,
            model=model,
            placement=placement,
            timeouts=ReplicaTimeouts(rendezvous_s=60, schedule_to_start_s=10, heartbeat_s=5),
        ),
        id=f"rendezvous/{rid}",
        task_queue=cluster.queue,
    )
    assert [h.rank for h in result.ranks] == [0, 1]
    assert cluster.head.stops == cluster.worker.stops == 0

    # The Ray head's port is the one reserved on the head's node, and
    # validation saw (and passed) the rendezvous that carries it.
    ray_port = cluster.head.reserved[0]
    assert cluster.worker.reserved == {}
    (validated,) = cluster.control.seen
    assert validated.rendezvous is not None
    assert validated.rendezvous.ray_port == ray_port
    assert validated.rendezvous.leader_address == "10.1.0.1"
    for node in (cluster.head, cluster.worker):
        (spec,) = node.specs
        assert spec.rendezvous == validated.rendezvous
    # The leader's HTTP port is its own pick, not the head's port.
    assert cluster.head.specs[0].port is None

    head_plan = cluster.head.plans[0]
    ray_head, serve = head_plan.commands
    assert ray_head.name == "ray-head" and ray_head.wait_for == ()
    assert ray_head.argv == (
        "ray", "start", "--head", "--port", str(ray_port),
        "--node-ip-address", "10.1.0.1", "--num-gpus", "2", "--block",
        "--include-dashboard=false",
    )  # fmt: skip
    assert serve.argv[:2] == ("vllm", "serve")
    assert serve.argv[serve.argv.index("--distributed-executor-backend") + 1] == "ray"
    assert serve.env == {"RAY_ADDRESS": f"10.1.0.1:{ray_port}"}
    assert [(e.host, e.port) for e in serve.wait_for] == [("10.1.0.1", ray_port)]
    assert head_plan.serves_http and head_plan.env["VLLM_API_KEY"] == KEY
    assert head_plan.env["VLLM_HOST_IP"] == "10.1.0.1"

    worker_plan = cluster.worker.plans[1]
    (join,) = worker_plan.commands
    assert join.name == "ray-worker"
    assert join.argv == (
        "ray", "start", "--address", f"10.1.0.1:{ray_port}",
        "--node-ip-address", "10.1.0.2", "--num-gpus", "2", "--block",
    )  # fmt: skip
    assert [(e.host, e.port) for e in join.wait_for] == [("10.1.0.1", ray_port)]
    assert not worker_plan.serves_http and "VLLM_API_KEY" not in worker_plan.env
    assert worker_plan.env["VLLM_HOST_IP"] == "10.1.0.2"
    # vLLM runs on the head only: the worker's node runs Ray and nothing else.
    assert not any("vllm" in arg for arg in join.argv)
