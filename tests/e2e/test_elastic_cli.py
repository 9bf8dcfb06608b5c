"""``llmgw scale --min/--max``, ``llmgw status``, ``llmgw explain`` and the
admin API's scale endpoint against a real control plane and router. The
model needs GPUs the node lacks, so no engine starts: these are about the
deployment's count, its bounds and the catalog entry."""

import asyncio
import subprocess
import sys

import httpx
from temporalio.client import Client

from llmgw import messages, replicas
from llmgw.queues import deployment_workflow_id
from llmgw.store import Store
from llmgw.types import AutoscalePolicy, LoadReport, ModelLoad
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, wait_deployment

ADMIN = "admin-elastic-cli"
MODEL = "tiny-cli-elastic"


def _cli(system: System, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=system.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


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

    scaled = await asyncio.to_thread(_cli, system, "scale", MODEL, "--max", "2")
    assert scaled.returncode == 0, scaled.stderr
    assert f"deployment/{MODEL}: 0 replicas desired (autoscale 0..2)" in scaled.stderr
    assert _stored(system) == AutoscalePolicy(min_replicas=0, max_replicas=2)

    listed = await asyncio.to_thread(_cli, system, "status")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if MODEL in line)
    cells = [c.strip() for c in row.strip().strip("│|").split("│")]
    assert cells == [MODEL, "0", "0", "0", "0", "0..2"], row

    # A router holding requests for the model at zero: the count follows.
    await client.get_workflow_handle(deployment_workflow_id(MODEL)).signal(
        messages.REPORT_LOAD,
        LoadReport(router_id="r", load=ModelLoad(model=MODEL, waiting=3, arrivals=3)),
    )
    await wait_deployment(client, MODEL, lambda s: s.desired == 1)
    explained = await asyncio.to_thread(_cli, system, "explain", MODEL)
    assert explained.returncode == 0, explained.stderr
    assert f"{MODEL}: autoscale 0..2, target 4 in flight per replica" in explained.stdout
    assert "scale 0 -> 1: 3 requests while scaled to zero" in explained.stdout

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
