"""The cluster proven as one (issue 36 §2): every process on its own host
with its own address, started from the cluster guide, and the scenarios run
against it through the load balancer with the official ``openai`` client.

One cluster for the module (its bring-up is the first scenario); each later
scenario leaves it as it found it: every host healed, every process up.
"""

import asyncio
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.temporal import connect
from llmgw.types import ReplicaPhase
from llmgw_cli.dev.tinymodel import TinyModel
from tests.cluster.netbed import Bed
from tests.cluster.stack import MODEL, NAMESPACE, Cluster

NODES = ["n1", "n2", "n3", "n4"]
CONTROLS = ["cp1", "cp2"]
ROUTERS = ["r1", "r2"]
HOSTS = ["temporal", "db", *CONTROLS, *ROUTERS, "lb", *NODES]
REPLICAS = 4


def _keep_logs(files: Path, into: Path) -> None:
    for log in files.rglob("*.log"):
        if log.is_file():
            dest = into / "-".join(log.relative_to(files).parts)
            shutil.copyfile(log, dest)


@pytest.fixture(scope="module")
def cluster(
    netns_ok: str | None, tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """The whole cluster, up: Temporal, PostgreSQL, two control workers, four
    agents, two routers behind HAProxy. Its logs are kept under pytest's temp dir."""
    if netns_ok:
        pytest.skip(netns_ok)
    logs = tmp_path_factory.mktemp("cluster-logs")
    with Bed.build(HOSTS) as bed:
        try:
            with Cluster(bed, bed.files, tiny, NODES) as built:
                built.start_services()
                for host in CONTROLS:
                    built.start_role("control", host)
                for host in NODES:
                    built.start_role("agent", host)
                for host in ROUTERS:
                    built.start_role("router", host)
                built.start_balancer(ROUTERS)
                yield built
        finally:
            _keep_logs(bed.files, logs)
            print(f"cluster logs: {logs}")


async def _client(cluster: Cluster) -> Client:
    return await connect(cluster.temporal.address, NAMESPACE)


async def _ready(client: Client, want: int, timeout_s: float) -> list[str]:
    """The nodes of the model's replicas, once exactly ``want`` serve."""
    async with asyncio.timeout(timeout_s):
        while True:
            status = await replicas.deployment_status(client, MODEL)
            live = [s for s in status.slots if s.replica_id and not s.next_start_at]
            memos = [await replicas.replica_memo(client, s.replica_id) for s in live]
            serving = [m for m in memos if m is not None and m.phase is ReplicaPhase.READY]
            if len(live) == len(status.slots) == len(serving) == status.desired == want:
                return sorted(s.node_id for s in live)
            await asyncio.sleep(0.5)


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"{done.args}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _served_by(cluster: Cluster, router: str) -> float:
    """Completions a router answered with 200, from its own /metrics."""
    r = httpx.get(
        cluster.router_url(router).removesuffix("/v1") + "/metrics",
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        timeout=10,
    )
    r.raise_for_status()
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith("llmgw_requests_total{") and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_bring_up_as_the_guide_says(cluster: Cluster) -> None:
    """Scenario 1: four agents register with their own addresses, a 4-replica
    model spreads over the four nodes, both routers behind the load balancer
    serve the official client, and ``llmgw status`` shows each node's address."""
    client = await _client(cluster)
    for node in NODES:
        await replicas.wait_node_registered(client, node, 120)
    fleet = await replicas.fleet_snapshot(client)
    assert {n: fleet.nodes[n].address for n in NODES} == {n: cluster.bed.address(n) for n in NODES}

    catalog = cluster.files / "catalog.yaml"
    catalog.write_text(
        "models:\n"
        f"  - name: {MODEL}\n"
        "    engine: llama.cpp\n"
        f"    source: {cluster.model_path}\n"
        f"    replicas: {REPLICAS}\n"
    )
    _ok(cluster.cli("model", "apply", str(catalog), "--deploy"))
    key = _ok(cluster.cli("keys", "create", "team-a", "--models", MODEL, "--rpm", "600"))
    api_key = key.strip().splitlines()[-1]
    cluster.api_key = api_key

    nodes = await _ready(client, REPLICAS, 240)
    assert nodes == NODES, f"the replicas share nodes: {nodes}"

    before = {r: _served_by(cluster, r) for r in ROUTERS}
    oai = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=api_key, max_retries=0)
    # Routers refresh their table on their own: wait until the model is routable.
    async with asyncio.timeout(60):
        while True:
            try:
                await oai.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                break
            except openai.APIStatusError:
                await asyncio.sleep(0.5)
    for _ in range(12):
        r = await oai.completions.create(model=MODEL, prompt="the river", max_tokens=4)
        assert r.usage is not None and r.usage.completion_tokens == 4
    after = {r: _served_by(cluster, r) for r in ROUTERS}
    assert all(after[r] > before[r] for r in ROUTERS), (before, after)

    shown = json.loads(_ok(cluster.cli("status", "--json")))
    text = json.dumps(shown)
    for node in NODES:
        assert re.search(re.escape(cluster.bed.address(node)), text), (node, shown)
