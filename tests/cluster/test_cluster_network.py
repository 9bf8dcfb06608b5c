"""The cluster across its network (issue 36 §2, scenarios 2, 9 and 10): a
llama.cpp replica whose two ranks run on two hosts, serving through a slow
and lossy link between the routers and the nodes, and weights fetched once
from an origin outside the cluster, then copied node to node over the bridge.

The module's cluster differs from the others' in its agents' settings: each
points at the Hub-compatible origin (tests/hub_server.py) that the test runs
in the root namespace, on the bed's root address, and the last node runs the
portable llama.cpp, which has no RPC server, so placement has a node to turn
down for the two-node model.
"""

import asyncio
import contextlib
import itertools
import json
import statistics
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from urllib.parse import urlsplit

import openai
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.queues import replica_workflow_id
from llmgw_cli.dev.tinymodel import TinyModel
from tests.cluster.netbed import Bed
from tests.cluster.scenario import (
    NODES,
    REPLICA_HEADER,
    client_of,
    cluster_up,
    deploy,
    ok,
    routable,
    serving,
)
from tests.cluster.stack import MODEL, Cluster, llmgw_bin
from tests.hub_server import HubServer
from worker_agent.installs.llamacpp import CHOICE_ENV

TWO_NODES = "tiny-two-nodes"
FROM_HUB = "tiny-from-hub"
HUB_REPO = "org/tiny"
GGUF = "tiny-llama.gguf"
# The node whose llama.cpp has no RPC server (LLMGW_LLAMA_CPP=portable).
PORTABLE = NODES[-1]
# Scenario 9: each way on every node's link, so a round trip gains twice it.
DELAY_MS = 200.0
LOSS_PCT = 5.0
SAMPLES = 15


@pytest.fixture(scope="module")
def origin(tiny: TinyModel) -> HubServer:
    """The origin of the hf:// source (served once the bed is up)."""
    hub = HubServer()
    hub.commit(HUB_REPO, {GGUF: tiny.model_path})
    return hub


@pytest.fixture(scope="module")
def cluster(
    netns_ok: str | None,
    tiny: TinyModel,
    rpc_llama_env: dict[str, str],
    origin: HubServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """The cluster, its agents pointed at the origin, the last one portable."""
    if netns_ok:
        pytest.skip(netns_ok)
    with ExitStack() as stack:

        def agent_env(bed: Bed, host: str) -> Mapping[str, str]:
            # The origin listens on the bridge's address, known only now; it
            # stops after the cluster (the stack unwinds last).
            if not origin.url:
                stack.enter_context(origin.running(bed.root_address))
            llama = {CHOICE_ENV: "portable"} if host == PORTABLE else rpc_llama_env
            return {**_hub_env(origin), **llama}

        logs = tmp_path_factory.mktemp("cluster-logs")
        built = stack.enter_context(cluster_up(tiny, logs, agent_env))
        yield built


@pytest.fixture(scope="module")
def key(cluster: Cluster) -> str:
    """A client key for every model of the module."""
    made = ok(cluster.cli("keys", "create", "net", "--models", f"{MODEL},{TWO_NODES},{FROM_HUB}"))
    return made.strip().splitlines()[-1]


def _hub_env(hub: HubServer) -> dict[str, str]:
    # The test server speaks no Xet.
    return {"LLMGW_HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}


def _apply(cluster: Cluster, entry: str, env: Mapping[str, str] | None = None) -> None:
    """``llmgw model apply --deploy`` of one catalog entry (YAML flow mapping),
    the operator's environment plus ``env``."""
    catalog = cluster.files / "network-catalog.yaml"
    catalog.write_text(f"models:\n  - {entry}\n")
    done = subprocess.run(
        [str(llmgw_bin()), "model", "apply", str(catalog), "--deploy"],
        env={**cluster.operator_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=cluster.files,
    )
    ok(done)


async def test_a_two_node_replica_spans_two_hosts(cluster: Cluster, key: str) -> None:
    """Scenario 2: rank 0 and rank 1 on two hosts, over llama.cpp RPC across the
    bridge, served through the load balancer; the portable node is turned down,
    and ``llmgw explain`` says why."""
    client = await client_of(cluster)
    for node in NODES:
        await replicas.wait_node_registered(client, node, 120)
    _apply(
        cluster,
        f"{{name: {TWO_NODES}, engine: llama.cpp, source: '{cluster.model_path}',"
        " replicas: 1, profile: {nodes: 2}}",
    )
    try:
        [(rid, _)] = (await serving(client, 1, 240, TWO_NODES)).items()
        placed = (await replicas.fleet_snapshot(client)).allocations[rid]
        ranks = [placed.node_id, *(w.node_id for w in placed.workers)]
        print(f"\n{TWO_NODES}: ranks on {ranks}")
        assert len(set(ranks)) == 2 and PORTABLE not in ranks, ranks

        explained = json.loads(ok(cluster.cli("explain", TWO_NODES, "--json")))
        why = {r["node_id"]: r["reason"] for r in explained["rejections"]}
        assert "has no RPC server" in why.get(PORTABLE, ""), explained
        assert all("RPC" not in why.get(n, "") for n in NODES if n != PORTABLE), explained

        oai = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
        try:
            await routable(cluster, 60, TWO_NODES, key)
            for _ in range(4):
                r = await oai.completions.create(model=TWO_NODES, prompt="the river", max_tokens=4)
                assert r.usage is not None and r.usage.completion_tokens == 4
        finally:
            await oai.close()
    finally:
        ok(cluster.cli("scale", TWO_NODES, "0"))


@dataclass(frozen=True)
class Figures:
    """Streamed time to first token and TCP round trips to the nodes, in seconds."""

    ttft: list[float]
    rtt: list[float]

    @property
    def ttft_s(self) -> float:
        return statistics.median(self.ttft)

    @property
    def rtt_s(self) -> float:
        return statistics.median(self.rtt)


async def _measure(oai: openai.AsyncOpenAI, peers: list[tuple[str, int]]) -> Figures:
    """``SAMPLES`` streamed completions one after another (none may fail) and
    as many TCP handshakes with each node (one round trip each)."""
    ttft = []
    for _ in range(SAMPLES):
        began = time.monotonic()
        first = 0.0
        stream = await oai.completions.create(
            model=MODEL, prompt="the river", max_tokens=4, stream=True
        )
        async for chunk in stream:
            if not first and chunk.choices and chunk.choices[0].text:
                first = time.monotonic() - began
        assert first, "a stream with no token"
        ttft.append(first)
    rtt = []
    for host, port in peers * (SAMPLES // len(peers)):
        began = time.monotonic()
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        rtt.append(time.monotonic() - began)
        writer.close()
        await writer.wait_closed()
    return Figures(ttft, rtt)


async def test_a_slow_lossy_link_adds_about_one_round_trip(cluster: Cluster) -> None:
    """Scenario 9: 200 ms each way and 5 % loss each way on the links of the
    nodes that serve (netem on each node host: it delays the node's path to
    Temporal too, which the replicas outlive): no request fails, and the
    median time to first token, streamed through one router, grows by about
    the round trip the link gained, not a multiple of it."""
    client = await client_of(cluster)
    key = deploy(cluster, 2)
    placed = await serving(client, 2, 240)
    await routable(cluster)
    nodes = sorted(set(placed.values()))
    fleet = await replicas.fleet_snapshot(client)
    # The agents' peer servers: a port on each node's link that answers a handshake.
    peers = []
    for n in nodes:
        url = urlsplit(fleet.nodes[n].peer_url)
        assert url.hostname and url.port, fleet.nodes[n].peer_url
        peers.append((url.hostname, url.port))
    oai = openai.AsyncOpenAI(base_url=cluster.router_url("r1"), api_key=key, max_retries=0)
    try:
        await _measure(oai, peers)  # warm: the router's connections to both engines
        base = await _measure(oai, peers)
        for n in nodes:
            cluster.bed.netem(n, delay_ms=DELAY_MS, loss_pct=LOSS_PCT)
        try:
            slow = await _measure(oai, peers)
        finally:
            for n in nodes:
                cluster.bed.clear_netem(n)
    finally:
        await oai.close()
    added_rtt = slow.rtt_s - base.rtt_s
    added_ttft = slow.ttft_s - base.ttft_s
    ratio = added_ttft / added_rtt
    print(
        f"\nnetem {DELAY_MS:.0f} ms and {LOSS_PCT:.0f} % each way on {nodes}: median TTFT"
        f" {base.ttft_s * 1000:.0f} -> {slow.ttft_s * 1000:.0f} ms (mean"
        f" {statistics.mean(base.ttft) * 1000:.0f} -> {statistics.mean(slow.ttft) * 1000:.0f},"
        f" max {max(slow.ttft) * 1000:.0f}); median RTT {base.rtt_s * 1000:.1f} ->"
        f" {slow.rtt_s * 1000:.0f} ms; added TTFT / added RTT = {ratio:.2f}"
    )
    assert added_rtt > 1.5 * DELAY_MS / 1000, "the link was not slowed"
    assert ratio < 3, f"time to first token grew by {ratio:.2f} round trips"
    await serving(client, 2, 60)


async def test_weights_come_from_the_origin_once_then_node_to_node(
    cluster: Cluster, key: str, origin: HubServer, tiny: TinyModel
) -> None:
    """Scenario 10: an hf:// source with a replica on each of three nodes: the
    origin serves the file once, the other nodes copy it from a node over the
    bridge (each replica's fetch says where its bytes came from), and every
    replica serves."""
    size = tiny.model_path.stat().st_size
    client = await client_of(cluster)
    want = 3
    before = origin.served_bytes
    _apply(
        cluster,
        f"{{name: {FROM_HUB}, engine: llama.cpp, source: 'hf://{HUB_REPO}/{GGUF}',"
        f" replicas: {want}}}",
        _hub_env(origin),
    )
    try:
        placed = await serving(client, want, 300, FROM_HUB)
        sources = {rid: await _fetched_from(client, rid) for rid in placed}
        gets = [p for m, p in origin.requests if m == "GET" and "/resolve/" in p]
        print(
            f"\n{FROM_HUB} on {sorted(placed.values())}: bytes by source"
            f" {sorted(sources.values(), key=str)}; origin sent"
            f" {origin.served_bytes - before} of {size} bytes in {len(gets)} GETs"
        )
        assert len(set(placed.values())) == want, placed
        assert origin.served_bytes - before == size, "the origin served the file more than once"
        from_origin = [s for s in sources.values() if s.get("origin")]
        assert from_origin == [{"origin": size}], sources
        for rid, got in sources.items():
            assert sum(got.values()) == size, (rid, got)
            # A peer is named by its node, never this replica's own.
            assert set(got) <= {"origin", *NODES} - {placed[rid]}, (rid, got)

        oai = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
        try:
            await routable(cluster, 60, FROM_HUB, key)
            served: set[str] = set()

            async def one(prompt: str) -> str:
                raw = await oai.completions.with_raw_response.create(
                    model=FROM_HUB, prompt=prompt, max_tokens=2
                )
                answer = raw.parse()
                assert answer.usage is not None and answer.usage.completion_tokens > 0
                return raw.headers.get(REPLICA_HEADER, "")

            # Routers learn each replica on a poll, and cache-aware routing keeps
            # a shared prefix on one replica: prompts that share none, sent
            # together (the least loaded goes first), until every replica served.
            with contextlib.suppress(TimeoutError):  # the assertion below says what served
                async with asyncio.timeout(90):
                    for i in itertools.count():
                        prompts = [f"{i * want + k} {'abcdefgh'[k % 8]} upon" for k in range(want)]
                        served |= set(await asyncio.gather(*(one(p) for p in prompts)))
                        if served == set(placed):
                            break
        finally:
            await oai.close()
        assert served == set(placed), f"replicas that served: {served} of {set(placed)}"
    finally:
        ok(cluster.cli("scale", FROM_HUB, "0"))


async def _fetched_from(client: Client, replica_id: str) -> dict[str, int]:
    """The bytes of a replica's weights by where they came from ("origin", or a
    peer's node id): its fetch activity's result, in the replica's history."""
    history = await client.get_workflow_handle(replica_workflow_id(replica_id)).fetch_history()
    for event in history.events:
        if not event.HasField("activity_task_completed_event_attributes"):
            continue
        for payload in event.activity_task_completed_event_attributes.result.payloads:
            result = json.loads(payload.data)
            if isinstance(result, dict) and "bytes_by_source" in result:
                return {str(k): int(v) for k, v in result["bytes_by_source"].items()}
    raise AssertionError(f"replica {replica_id} fetched nothing")
