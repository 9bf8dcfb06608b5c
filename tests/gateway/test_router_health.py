"""The router's own health evidence: node-lost replicas stay routed while
their engine answers its probe; an engine that refused a connection is passed
over while another serves; only endpoints on registered nodes are routed."""

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.client import Client

from llmgw import contracts
from llmgw.queues import replica_workflow_id
from llmgw.types import ReplicaMemo, ReplicaPhase
from router.control_link.replica_source import TemporalReplicaSource
from router.control_link.routing import Route, RoutingTable, on_registered_nodes
from tests.gateway_util import MockEngine, auth, gateway, ready, spec


def _memo(
    rid: str, node: str, endpoint: str, phase: ReplicaPhase = ReplicaPhase.READY
) -> ReplicaMemo:
    return ReplicaMemo(replica_id=rid, model="m", phase=phase, node_id=node, endpoint=endpoint)


def test_only_endpoints_on_their_registered_node_are_kept() -> None:
    nodes = {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    good = _memo("good", "n1", "http://10.0.0.1:18000")
    elsewhere = _memo("elsewhere", "n1", "http://203.0.113.9:18000")  # n1 is not there
    unknown = _memo("unknown", "forged", "http://10.0.0.1:18001")
    other_node = _memo("swap", "n2", "http://10.0.0.1:18002")  # n1's address, n2's name
    placing = _memo("placing", "", "", ReplicaPhase.PLACING)
    kept, foreign = on_registered_nodes([good, elsewhere, unknown, other_node, placing], nodes)
    assert [m.replica_id for m in kept] == ["good", "placing"]
    assert [m.replica_id for m in foreign] == ["elsewhere", "unknown", "swap"]


async def test_a_forged_replica_memo_is_not_routed(client: Client) -> None:
    """A Replica workflow anyone started, its memo pointing at a foreign host."""
    rid = f"forged-{uuid.uuid4().hex[:8]}"
    memo = _memo(rid, f"node-{rid}", "http://203.0.113.7:80")
    handle = await client.start_workflow(
        "Replica",
        id=replica_workflow_id(rid),
        task_queue=f"nobody-{rid}",  # no worker: it just sits there, running
        memo=contracts.REPLICA_MEMO.encode(memo),
    )
    try:
        source = TemporalReplicaSource(client)
        async with asyncio.timeout(30):
            while True:  # visibility lags a start a little
                listed = [wf.id async for wf in client.list_workflows(f'WorkflowId="{handle.id}"')]
                if listed:
                    break
                await asyncio.sleep(0.1)
        assert rid not in [m.replica_id for m in await source.replicas()]
    finally:
        await handle.terminate("test over")


def test_candidates_pass_over_an_ejected_replica_unless_none_is_left() -> None:
    table = RoutingTable()
    table.update([_memo("a", "n1", "http://h:1"), _memo("b", "n1", "http://h:2")], {})
    a, b = table.routes["m"]
    a.eject(60)
    assert [r.replica_id for r in table.candidates("m")] == ["b"]
    b.eject(60)
    # Both just failed: trying one beats refusing outright.
    assert {r.replica_id for r in table.candidates("m")} == {"a", "b"}


def test_node_lost_replicas_are_routed_while_they_answer() -> None:
    table = RoutingTable()
    table.update([_memo("a", "n1", "http://h:1", ReplicaPhase.NODE_LOST)], {})
    [route] = table.routes["m"]
    assert route.node_lost and table.lost_routes() == [route]
    assert table.candidates("m") == [route]
    route.answering = False
    assert table.candidates("m") == [] and not table.has_replicas("m")
    # Its agent is back: it vouches for the engine again.
    table.update([_memo("a", "n1", "http://h:1")], {})
    assert table.candidates("m") == [route] and not route.node_lost


@dataclass
class ScriptedProbe:
    """Answers as the test says; counts probes per replica."""

    answering: dict[str, bool]
    probed: dict[str, int] = field(default_factory=dict)

    async def answers(self, route: Route) -> bool:
        self.probed[route.replica_id] = self.probed.get(route.replica_id, 0) + 1
        return self.answering[route.replica_id]

    async def aclose(self) -> None:
        return None


async def test_the_router_probes_node_lost_engines_and_routes_by_the_answer(
    tmp_path: Path,
) -> None:
    lost = _memo("lost-1", "n1", "http://lost:1", ReplicaPhase.NODE_LOST)
    probe = ScriptedProbe({"lost-1": True})
    engine = MockEngine()
    async with gateway(tmp_path / "s.db", [lost], [spec("m")], engine, probe=probe) as gw:
        _, key = gw.key()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
        assert r.status_code == 200
        probe.answering["lost-1"] = False
        async with asyncio.timeout(10):
            while (
                await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
            ).status_code == 200:
                await asyncio.sleep(0.05)
        r = await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"
        probe.answering["lost-1"] = True
        async with asyncio.timeout(10):
            while (
                await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
            ).status_code != 200:
                await asyncio.sleep(0.05)
    assert probe.probed["lost-1"] >= 2


async def test_a_refused_connection_sends_the_next_requests_elsewhere(tmp_path: Path) -> None:
    engine = MockEngine(down={"down"})
    memos = [ready("a", "m", "http://down:1"), ready("b", "m", "http://up:1")]
    async with gateway(tmp_path / "s.db", memos, [spec("m")], engine) as gw:
        _, key = gw.key()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(6):
            r = await gw.http.post("/v1/chat/completions", json=body, headers=auth(key))
            assert r.status_code == 200
    # The refusing engine was tried once; then passed over while "up" served
    # (taking turns, it would have been tried for every other request).
    assert engine.refused == ["down"]
    assert [req.url.host for req in engine.seen] == ["up"] * 6
