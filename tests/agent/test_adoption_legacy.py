"""Upgrade path for endpoint proofs (issue 23 item 5): a pass-through started by
an llmgw from before them answers no proof, so no router sends it a request.
A restarted (upgraded) agent still adopts it, and says so: a warning naming
the command that replaces it, and the agent.adopt span's attributes. Spec files
written by older agents have no ``endpoint_proofs``; new launches record it."""

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.testing import ActivityEnvironment

from llmgw.types import EngineKind, LaunchShardInput, ModelSpec, ShardRef, ShardSpec, StopShardInput
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import wait_for
from tests.harness import node_activities
from tests.procs_util import pids_with_args, stopped_after
from worker_agent.adoption import adopt
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import Supervisor

ENGINE = "import time\nwhile True: time.sleep(1)\n"


@pytest.fixture
def first(tmp_path: Path) -> Iterator[Supervisor]:
    """The agent that started the engines; kept so its Popen objects reap them."""
    with stopped_after(Supervisor(tmp_path, "n1")) as sup:
        yield sup


def _launch(sup: Supervisor, replica: str, record: ShardRecord) -> ShardRef:
    tag = f"tag-legacy-{replica}"
    ref = ShardRef(replica_id=replica)
    command = Command([sys.executable, "-c", ENGINE, tag], dict(os.environ))
    sup.launch(ref, [command], 1, "http://127.0.0.1:1", record)
    assert wait_for(lambda: len(pids_with_args(tag)) == 1, 10)
    return ref


def test_a_pass_through_from_before_endpoint_proofs_is_adopted_with_a_warning(
    first: Supervisor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = _launch(first, "r-old", ShardRecord(model="m-old"))
    _launch(first, "r-new", ShardRecord(model="m-new", endpoint_proofs=True))
    worker = _launch(first, "r-old-w", ShardRecord(model="m-old", serves_http=False))
    # The old agent's spec files: no endpoint_proofs key at all.
    for ref in (old, worker):
        path = first.shard_dir(ref) / "spec.json"
        data = json.loads(path.read_text())
        del data["spec"]["endpoint_proofs"]
        path.write_text(json.dumps(data))

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    second = Supervisor(tmp_path, "n1")
    with (
        caplog.at_level(logging.WARNING, logger="worker_agent.adoption"),
        provider.get_tracer(__name__).start_as_current_span("agent.adopt"),
    ):
        report = adopt(second)

    assert sorted(r.ref.replica_id for r in report.adopted) == ["r-new", "r-old", "r-old-w"]
    assert report.unproven == [old]  # a worker rank serves no HTTP: nothing to prove
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "replica r-old: pass-through predates endpoint proofs; it is not routed "
        "until the model is rolled: llmgw restart m-old"
    ]
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None and span.attributes["llmgw.unproven"] == ("r-old",)


@pytest.mark.timeout(300)
async def test_a_new_launch_records_that_it_answers_endpoint_proofs(
    llama: LlamaCppInstall, tiny: TinyModel, tmp_path: Path
) -> None:
    sup = Supervisor(tmp_path)
    acts = node_activities(llama, sup)
    ref = ShardRef(replica_id="proofs-1")
    model = ModelSpec(name="tiny-proofs", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    env = ActivityEnvironment()
    await env.run(
        acts.launch_shard, LaunchShardInput(spec=ShardSpec(replica_id=ref.replica_id, model=model))
    )
    try:
        assert sup.plan_of(ref).endpoint_proofs is True
        assert adopt(Supervisor(tmp_path)).unproven == []
    finally:
        await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
        await acts.aclose()
