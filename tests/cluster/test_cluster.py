"""The cluster proven as one (issue 36 §2): every process on its own host
with its own address, started from the cluster guide, and served through the
load balancer to the official ``openai`` client."""

import json

import openai

from llmgw import replicas
from tests.cluster.scenario import (
    NODES,
    REPLICAS,
    ROUTERS,
    client_of,
    deploy,
    ok,
    routable,
    served_by,
    serving,
)
from tests.cluster.stack import MODEL, Cluster


async def test_bring_up_as_the_guide_says(cluster: Cluster) -> None:
    """Scenario 1: four agents register with their own addresses, a 4-replica
    model spreads over the four nodes, both routers behind the load balancer
    serve the official client, and ``llmgw status`` shows each node's address."""
    client = await client_of(cluster)
    for node in NODES:
        await replicas.wait_node_registered(client, node, 120)
    fleet = await replicas.fleet_snapshot(client)
    assert {n: fleet.nodes[n].address for n in NODES} == {n: cluster.bed.address(n) for n in NODES}

    key = deploy(cluster)
    placed = await serving(client, REPLICAS, 240)
    assert sorted(placed.values()) == NODES, f"the replicas share nodes: {placed}"

    await routable(cluster)
    before = {r: served_by(cluster, r) for r in ROUTERS}
    oai = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
    for _ in range(12):
        r = await oai.completions.create(model=MODEL, prompt="the river", max_tokens=4)
        assert r.usage is not None and r.usage.completion_tokens == 4
    await oai.close()
    after = {r: served_by(cluster, r) for r in ROUTERS}
    assert all(after[r] > before[r] for r in ROUTERS), (before, after)

    shown = json.loads(ok(cluster.cli("status", "--json")))
    assert {n["node_id"]: n["address"] for n in shown["nodes"]} == {
        n: cluster.bed.address(n) for n in NODES
    }
