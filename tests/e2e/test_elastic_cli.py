"""``llmgw scale --min/--max``, ``llmgw status``, ``llmgw explain`` (tables
and ``--json``) and the admin API's scale endpoint against a real control
plane and router. The model needs GPUs the node lacks, so no engine starts:
these are about the deployment's count, its bounds and the catalog entry."""

import asyncio
import json
import subprocess
import sys
from typing import Any

import httpx
from temporalio.client import Client

from llmgw import contracts, replicas
from llmgw.queues import deployment_workflow_id
from llmgw.store import Store
from llmgw.types import AutoscalePolicy, LoadReport, ModelLoad
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, wait_deployment

ADMIN = "admin-elastic-cli"
MODEL = "tiny-cli-elastic"
# The documented shapes (docs/reference/cli-json.md).
DEPLOYMENT = {"model", "desired", "ready", "inflight", "waiting", "autoscale", "slots"}
SLOT = {"slot", "replica_id", "ready", "starts", "failures", "reaped", "last_reason"}
REPLICA = {"replica_id", "model", "phase", "node_id", "endpoint", "progress"}
NODE = {"node_id", "hostname", "address", "peer_url", "state"}
BOUNDS = {"min_replicas": 0, "max_replicas": 2, "target_inflight": 4.0}


def _cli(system: System, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=system.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def _replica_listed(client: Client) -> str:
    """The id of the model's replica, once Temporal's list has it."""
    async with asyncio.timeout(120):
        while True:
            found = [m for m in await replicas.list_replicas(client) if m.model == MODEL]
            if found:
                return found[0].replica_id
            await asyncio.sleep(0.2)


async def _json_while_placing(system: System, client: Client) -> None:
    """``explain --json`` and ``status --json`` once the load woke the model."""
    explain = _json(await asyncio.to_thread(_cli, system, "explain", MODEL, "--json"))
    assert set(explain) == {
        "model", "placement", "preemption", "rejections", "shared", "deployment", "fetching"
    }  # fmt: skip
    assert (explain["model"], explain["placement"], explain["preemption"]) == (MODEL, None, None)
    assert explain["fetching"] == []  # a local file: nothing to fetch
    assert explain["shared"] == []  # no replica placed: none shares a node
    assert all(set(r) == {"node_id", "reason"} for r in explain["rejections"])
    assert "cli-node" in [r["node_id"] for r in explain["rejections"]]  # 8 GPUs, it has none
    scaling = explain["deployment"]
    assert set(scaling) == {"desired", "autoscale", "inflight", "waiting", "routers", "decisions"}
    assert (scaling["desired"], scaling["autoscale"]) == (1, BOUNDS)
    last = scaling["decisions"][-1]
    assert set(last) == {"at", "from_replicas", "to_replicas", "reason"}
    assert (last["from_replicas"], last["to_replicas"]) == (0, 1)
    assert last["reason"].startswith("scale 0 -> 1: 3 requests while scaled to zero")
    # The replica it started waits for room (placing): status lists it, and the slot.
    replica_id = await _replica_listed(client)
    status = _json(await asyncio.to_thread(_cli, system, "status", "--json"))
    rows = [r for r in status["replicas"] if r["model"] == MODEL]
    assert [r["replica_id"] for r in rows] == [replica_id]
    assert set(rows[0]) == REPLICA and rows[0]["endpoint"] == ""
    assert rows[0]["progress"] == []  # placing, not fetching
    (mine,) = [d for d in status["deployments"] if d["model"] == MODEL]
    assert (mine["desired"], mine["ready"], mine["autoscale"]) == (1, 0, BOUNDS)
    assert [set(s) for s in mine["slots"]] == [SLOT]
    assert mine["slots"][0]["ready"] is False


def _lists_the_node(table: str, status: Any) -> None:
    """``status`` (table and ``--json``) lists the node with the address
    routers reach its engines at."""
    row = next(line for line in table.splitlines() if "cli-node" in line)
    assert "127.0.0.1" in row and "up" in row, row
    assert set(status) == {"replicas", "deployments", "nodes"}
    (node,) = [n for n in status["nodes"] if n["node_id"] == "cli-node"]
    assert set(node) == NODE
    assert (node["address"], node["state"]) == ("127.0.0.1", "up")


def _stored(system: System) -> AutoscalePolicy | None:
    store = Store(system.store_url)
    try:
        spec = store.get_model(MODEL)
        assert spec is not None
        return spec.autoscale
    finally:
        store.close()


async def test_scale_status_explain_and_the_admin_api(
    system: System, client: Client, tiny: TinyModel
) -> None:
    system.env["LLMGW_ADMIN_KEY"] = ADMIN
    started = await system.start(client, "cli-node")
    catalog = system.work_dir / "catalog.yaml"
    catalog.write_text(
        f"models:\n  - name: {MODEL}\n    source: {tiny.model_path}\n    gpus: 8\n"
        "    replicas: 0\n    autoscale: {min_replicas: 0, max_replicas: 4}\n"
    )
    applied = await asyncio.to_thread(_cli, system, "model", "apply", str(catalog), "--deploy")
    assert applied.returncode == 0, applied.stderr
    assert f"deployment/{MODEL}: 0 replicas desired (autoscale 0..4)" in applied.stderr

    scaled = await asyncio.to_thread(_cli, system, "scale", MODEL, "--max", "2", "--json")
    assert scaled.returncode == 0, scaled.stderr
    assert f"deployment/{MODEL}: 0 replicas desired (autoscale 0..2)" in scaled.stderr
    deployment = _json(scaled)
    assert set(deployment) == DEPLOYMENT
    assert deployment == {
        "model": MODEL, "desired": 0, "ready": 0, "inflight": 0, "waiting": 0,
        "autoscale": BOUNDS, "slots": [],
    }  # fmt: skip
    assert _stored(system) == AutoscalePolicy(min_replicas=0, max_replicas=2)

    listed = await asyncio.to_thread(_cli, system, "status")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if MODEL in line)
    cells = [c.strip() for c in row.strip().strip("│|").split("│")]
    assert cells == [MODEL, "0", "0", "0", "0", "0..2"], row
    status = _json(await asyncio.to_thread(_cli, system, "status", "--json"))
    _lists_the_node(listed.stdout, status)
    assert [r for r in status["replicas"] if r["model"] == MODEL] == []
    mine = [d for d in status["deployments"] if d["model"] == MODEL]
    assert mine == [deployment]
    assert all(set(d) == DEPLOYMENT for d in status["deployments"])

    # A router holding requests for the model at zero: the count follows.
    await contracts.REPORT_LOAD.send(
        client.get_workflow_handle(deployment_workflow_id(MODEL)),
        LoadReport(router_id="r", load=ModelLoad(model=MODEL, waiting=3, arrivals=3)),
    )
    await wait_deployment(client, MODEL, lambda s: s.desired == 1)
    explained = await asyncio.to_thread(_cli, system, "explain", MODEL)
    assert explained.returncode == 0, explained.stderr
    assert f"{MODEL}: autoscale 0..2, target 4 in flight per replica" in explained.stdout
    assert "scale 0 -> 1: 3 requests while scaled to zero" in explained.stdout
    await _json_while_placing(system, client)

    async with httpx.AsyncClient(
        base_url=started.root, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60
    ) as http:
        r = await http.post(
            f"/admin/models/{MODEL}/scale", json={"min_replicas": 1, "max_replicas": 3}
        )
        assert r.status_code == 200, r.text
        assert r.json()["autoscale"]["max_replicas"] == 3 and r.json()["desired"] == 1
        bad = await http.post(
            f"/admin/models/{MODEL}/scale", json={"min_replicas": 4, "max_replicas": 2}
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "autoscale.max_replicas"
        missing = await http.post("/admin/models/nope/scale", json={"replicas": 1})
        assert missing.status_code == 404
    assert _stored(system) == AutoscalePolicy(min_replicas=1, max_replicas=3)

    # A fixed zero: autoscaling off, in the catalog too, and the deployment ends.
    fixed = await asyncio.to_thread(_cli, system, "scale", MODEL, "--replicas", "0")
    assert fixed.returncode == 0, fixed.stderr
    assert _stored(system) is None
    handle = client.get_workflow_handle(deployment_workflow_id(MODEL))
    final = await asyncio.wait_for(handle.result(), 60)
    assert final["desired"] == 0 and final["autoscale"] is None
    assert [d["reason"] for d in final["decisions"]][-1].startswith("scale 0 -> 1")
    assert (await replicas.list_deployments(client)) == []
