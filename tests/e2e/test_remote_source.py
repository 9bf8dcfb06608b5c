"""Catalog entries whose source is remote (``hf://``, ``s3://``): the node fetches the pinned file
from a Hub-compatible server on loopback (tests/hub_server.py, through the
agent's artifact cache), the engine serves it, and the official ``openai``
client gets a completion through the router.

The repo is gated: the agent's token (LLMGW_HF_TOKEN) reads it, and is never
in a workflow history or a process log. While the bytes arrive (the server
trickles them), ``llmgw status`` and the fetch activity's heartbeat show the
progress. A second replica of the model on the node fetches nothing.
"""

import asyncio
import json
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai
from temporalio.client import Client

from llmgw import replicas
from llmgw.hub_pin import Hub, pin_hf
from llmgw.queues import replica_workflow_id
from llmgw.sources import HfSource
from llmgw.store import Store
from llmgw.types import EngineKind, ModelSpec, ReplicaPhase, ReplicaStatus
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, wait_routable
from tests.hub_server import HubServer
from tests.s3_server import S3Server

MODEL = "tiny-from-hub"
REPO = "org/tiny-gated"
GGUF = "tiny-llama.gguf"
TOKEN = "hf_agent_token_0123456789abcdef"
S3_SECRET = "s3-e2e-secret-never-shown"


def _served_from(
    system: System, hub: HubServer, repo: str, token: str = "", *, spread: bool = False
) -> ModelSpec:
    """The tiny GGUF of ``repo`` on ``hub`` pinned (as model apply pins it) in an
    entry, and this system's processes pointed at the hub."""
    pin = pin_hf(HfSource(repo, None, GGUF), EngineKind.LLAMA_CPP, None, [], Hub(hub.url, token))
    system.env.update({"LLMGW_HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"})
    return ModelSpec(name=MODEL, source=f"hf://{repo}/{GGUF}", pin=pin, spread=spread)


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.2)
    return True


async def _history_text(client: Client, replica_id: str) -> str:
    handle = client.get_workflow_handle(replica_workflow_id(replica_id))
    history = await handle.fetch_history()
    return json.dumps(history.to_json_dict())


async def test_an_hf_source_serves_a_completion_fetched_once_with_progress(
    system: System, client: Client, tiny: TinyModel
) -> None:
    hub = HubServer()
    hub.commit(REPO, {GGUF: tiny.model_path, "README.md": tiny.model_path})
    hub.repos[REPO].gated = True
    hub.repos[REPO].readers.add(TOKEN)
    size = tiny.model_path.stat().st_size
    with hub.running():
        spec = _served_from(system, hub, REPO, TOKEN)
        assert spec.pin is not None and [f.path for f in spec.pin.manifest.files] == [GGUF]
        key = system.catalog(spec)
        system.env["LLMGW_HF_TOKEN"] = TOKEN  # the agent's, to read the gated repo
        # Minutes for the file, cut short once the progress is seen (the hub reads
        # the delay at each chunk): a loaded machine must not finish it first.
        hub.chunk_delay_s = 120 / max(1, size // (64 * 1024))
        started = await system.start(client, "hub-node")
        replica_id = await replicas.start_replica(client, spec)

        async def moving() -> bool:
            found = await replicas.fetch_progress(client, replica_id)
            return any(0 < p.bytes_done < p.bytes_total == size for p in found)

        assert await _until(moving, 60), "no fetch progress was heartbeated"
        (progress,) = await replicas.fetch_progress(client, replica_id)
        assert progress.source == "origin" and progress.files_total == 1
        shown = system.cli("status")
        assert shown.returncode == 0, shown.stderr
        assert "fetching" in shown.stdout and "from origin" in shown.stdout, shown.stdout
        hub.chunk_delay_s = 0.0

        memo = await replicas.wait_ready(client, replica_id, 180)
        assert memo.phase is ReplicaPhase.READY
        await wait_routable(f"{started.root}/v1", key, MODEL)
        oai = openai.AsyncOpenAI(base_url=f"{started.root}/v1", api_key=key, max_retries=0)
        try:
            answer = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
            )
        finally:
            await oai.close()
        assert answer.choices[0].message.content
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        # Every byte of the file once: a resume sends only what is missing.
        assert hub.served_bytes == size

        # A second replica on the node finds the artifact in the cache.
        second = await replicas.start_replica(client, spec)
        await replicas.wait_ready(client, second, 180)
        assert hub.served_bytes == size

    for rid in (replica_id, second):
        assert TOKEN not in await _history_text(client, rid)
        await replicas.stop_replica(client, rid, "test over", 30)
    for child in system.children:
        assert TOKEN not in child.log_path.read_text(errors="replace"), child.name


async def test_model_pull_fetches_to_every_node_ahead_of_a_deploy(
    system: System, client: Client, tiny: TinyModel
) -> None:
    """``llmgw model pull`` runs the ModelPull job: each live node gets the
    pinned file (progress printed as the nodes heartbeat it), the second from
    the first's peer server (the origin serves it once), and a replica
    started afterwards takes it from its node's cache, fetching nothing."""
    hub = HubServer()
    hub.commit("org/tiny", {GGUF: tiny.model_path})
    size = tiny.model_path.stat().st_size
    with hub.running():
        spec = _served_from(system, hub, "org/tiny")
        system.catalog(spec)
        # About 24 s: Temporal sends heartbeat details on at most every 8 s (0.8
        # of the heartbeat timeout) after the first, and the CLI polls each 1 s.
        hub.chunk_delay_s = 24 / max(1, size // (64 * 1024))
        await system.start(client, "pull-a", "pull-b", own_ports=True)
        pulled = await asyncio.to_thread(system.cli, "model", "pull", MODEL)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        said = pulled.stdout
        assert re.search(r"pull-a: fetching [\d.]+ / [\d.]+ MiB at \d+ MiB/s from origin", said), (
            said
        )
        assert f"pull-a: fetched, {size} bytes" in said and f"pull-b: fetched, {size} bytes" in said
        # pull-b asked pull-a (the pull's tree) and followed its growing partial.
        assert hub.served_bytes == size
        again = await asyncio.to_thread(system.cli, "model", "pull", MODEL, "--nodes", "pull-b")
        assert f"pull-b: already held, {size} bytes" in again.stdout, again.stdout

        replica_id = await replicas.start_replica(client, spec)
        await replicas.wait_ready(client, replica_id, 180)
        status = await replicas.status_of(client, replica_id)
        assert status is not None
        assert any("weights from the node's cache" in h.detail for h in status.history)
        assert hub.served_bytes == size
        await replicas.stop_replica(client, replica_id, "test over", 30)


async def test_an_agent_killed_mid_fetch_resumes_from_its_bytes(
    system: System, client: Client, tiny: TinyModel
) -> None:
    """SIGKILL the agent at about 60 % of the file: the fetch activity times out
    on its heartbeat, Temporal runs it again on the node's queue once a new
    agent serves it, and the fetch goes on from the bytes on disk (Range)."""
    hub = HubServer()
    hub.commit("org/tiny", {GGUF: tiny.model_path})
    size = tiny.model_path.stat().st_size
    with hub.running():
        spec = _served_from(system, hub, "org/tiny")
        system.catalog(spec)
        hub.chunk_delay_s = 20 / max(1, size // (64 * 1024))
        started = await system.start(client, "kill-node")
        [agent] = started.agents
        replica_id = await replicas.start_replica(client, spec)

        async def past_half() -> bool:
            return hub.served_bytes >= 0.6 * size

        assert await _until(past_half, 90)
        agent.signal(signal.SIGKILL)
        agent.proc.wait()
        at_kill = hub.served_bytes
        hub.chunk_delay_s = 0.0
        system.spawn("agent", {"LLMGW_NODE_ID": "kill-node"})
        memo = await replicas.wait_ready(client, replica_id, 180)
        assert memo.phase is ReplicaPhase.READY
        again = hub.served_bytes - at_kill
        # What was on disk is not asked for again: only the rest, and what the
        # kill cut between the server's send and the agent's write (a chunk).
        assert again <= size - at_kill + 2 * 64 * 1024, (again, size, at_kill)
        assert hub.served_bytes < 1.2 * size
        await replicas.stop_replica(client, replica_id, "test over", 30)


async def test_a_fetch_the_hub_refuses_fails_the_replica_naming_why(
    system: System, client: Client, tiny: TinyModel
) -> None:
    """A gated repo and an agent without its token: refused (401), never retried,
    and the replica ends failed with a reason naming the file and the status."""
    hub = HubServer()
    hub.commit(REPO, {GGUF: tiny.model_path})
    hub.repos[REPO].gated = True
    hub.repos[REPO].readers.add(TOKEN)
    with hub.running():
        spec = _served_from(system, hub, REPO, TOKEN)  # pinned with it; the agent has none
        system.catalog(spec)
        await system.start(client, "refused-node")
        replica_id = await replicas.start_replica(client, spec)
        handle = client.get_workflow_handle(replica_workflow_id(replica_id))
        final = await asyncio.wait_for(handle.result(), 120)
        status = ReplicaStatus.model_validate(final)
        assert status.phase is ReplicaPhase.FAILED
        assert "SourceRefused" in status.reason and GGUF in status.reason, status.reason
        assert "401" in status.reason, status.reason
        assert hub.served_bytes == 0
        gets = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
        assert len(gets) == 1, gets  # refused once, not retried


async def test_an_s3_source_serves_a_completion_read_with_its_storage_profile(
    system: System, client: Client, tiny: TinyModel, tmp_path: Path
) -> None:
    """``source: s3://...`` with ``storage_profile: lab``: ``llmgw model apply``
    pins the object (its ETag), the node fetches it from a presigned URL made
    with the profile of that name (LLMGW_STORAGE_PROFILES), and the router
    serves it to the openai client. The profile's secret is in no history or
    log, and every byte is served once."""
    s3 = S3Server()
    with s3.running():
        s3.bucket("llmgw-e2e")
        s3.put("llmgw-e2e", f"tiny/{GGUF}", tiny.model_path)
        size = tiny.model_path.stat().st_size
        lab = {
            "endpoint_url": s3.url,
            "region": "us-east-1",
            "access_key_id": "AKIAE2E0000000000000",
            "secret_access_key": S3_SECRET,
            "addressing_style": "path",
        }
        # "default" reaches nothing: only the entry's own profile can read it.
        nowhere = {**lab, "endpoint_url": "http://127.0.0.1:1"}
        system.env["LLMGW_STORAGE_PROFILES"] = json.dumps({"default": nowhere, "lab": lab})
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(
            f"models:\n  - {{name: {MODEL}, source: 's3://llmgw-e2e/tiny/{GGUF}',"
            " storage_profile: lab}\n"
        )
        applied = await asyncio.to_thread(system.cli, "model", "apply", str(catalog))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        store = Store(system.store_url)
        try:
            spec = store.get_model(MODEL)
        finally:
            store.close()
        assert spec is not None and spec.pin is not None and spec.storage_profile == "lab"
        key = system.catalog()
        started = await system.start(client, "s3-node")
        replica_id = await replicas.start_replica(client, spec)
        await replicas.wait_ready(client, replica_id, 180)
        await wait_routable(f"{started.root}/v1", key, MODEL)
        oai = openai.AsyncOpenAI(base_url=f"{started.root}/v1", api_key=key, max_retries=0)
        try:
            answer = await oai.completions.create(model=MODEL, prompt="Once", max_tokens=4)
        finally:
            await oai.close()
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        assert s3.served_bytes == size
        assert S3_SECRET not in await _history_text(client, replica_id)
        await replicas.stop_replica(client, replica_id, "test over", 30)
    for child in system.children:
        assert S3_SECRET not in child.log_path.read_text(errors="replace"), child.name


async def test_a_second_node_fetches_from_the_first_not_the_origin(
    system: System, client: Client, tiny: TinyModel
) -> None:
    """Two agents, each serving its cache to the other (peer servers on free
    ports, advertised in their inventories). A replica on one node fetches
    from the origin; a second replica, spread to the other node, finds the
    first in the fleet and fetches from its peer server: the origin serves
    the file once for the cluster, and both engines serve."""
    hub = HubServer()
    hub.commit("org/tiny", {GGUF: tiny.model_path})
    size = tiny.model_path.stat().st_size
    with hub.running():
        spec = _served_from(system, hub, "org/tiny", spread=True)
        key = system.catalog(spec)
        started = await system.start(client, "peer-a", "peer-b", own_ports=True)
        fleet = await replicas.fleet_snapshot(client)
        assert all(fleet.nodes[n].peer_url.startswith("http://127.0.0.1:") for n in fleet.nodes)
        first = await replicas.start_replica(client, spec)
        await replicas.wait_ready(client, first, 180)
        assert hub.served_bytes == size
        second = await replicas.start_replica(client, spec)
        await replicas.wait_ready(client, second, 180)
        nodes = {(await replicas.replica_memo(client, r)).node_id for r in (first, second)}  # type: ignore[union-attr]
        assert nodes == {"peer-a", "peer-b"}
        assert hub.served_bytes == size, "the second node went to the origin"
        await wait_routable(f"{started.root}/v1", key, MODEL)
        oai = openai.AsyncOpenAI(base_url=f"{started.root}/v1", api_key=key, max_retries=0)
        try:
            for _ in range(2):
                answer = await oai.completions.create(model=MODEL, prompt="Once", max_tokens=2)
                assert answer.usage is not None and answer.usage.completion_tokens > 0
        finally:
            await oai.close()
        agent_logs = "".join(
            c.log_path.read_text(errors="replace") for c in system.children if c.name == "agent"
        )
        assert f"replica {second}: asking peers peer-" in agent_logs
        for rid in (first, second):
            await replicas.stop_replica(client, rid, "test over", 30)
