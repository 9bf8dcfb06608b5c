"""Stored histories of representative runs replay against today's code.

Each file in ``tests/histories`` was recorded from a real run (see
tests/recording.py): a replica started and stopped, drained with a request in
flight, failing when its engine exits, preempting and preempted (a multi-node one
preempting one replica on each of its nodes); deployments
scaled up and down, restarting a crashing engine until reaped, rolled,
continued as new and cancelled; autoscaled on load reports (continuing as
new under them), scaled to zero and woken; a node drained. A change that would break
workflows in flight (non-determinism) fails here, not in production.
"""

from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.recording import HISTORIES
from workflows.worker import WORKFLOWS

EXPECTED = {
    "deployment_autoscale",
    "deployment_cancelled",
    "deployment_continued_as_new",
    "deployment_crashloop_reaped",
    "deployment_crashloop_reaped_holds",
    "deployment_preempted",
    "deployment_rolling_restart",
    "deployment_scale_down_least_loaded",
    "deployment_scale_to_zero_wake",
    "deployment_scale_up_down",
    "drain_node",
    "replica_drain_in_flight",
    "replica_engine_exit",
    "replica_preempted",
    "replica_preemptor",
    "replica_preemptor_multi_node",
    "replica_ready_stop",
    "replica_ready_stop_fetch",
}


def test_every_representative_run_is_stored() -> None:
    assert {p.stem for p in HISTORIES.glob("*.json")} >= EXPECTED


async def test_stored_histories_still_replay() -> None:
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    for path in sorted(HISTORIES.glob("*.json")):
        history = WorkflowHistory.from_json(path.stem, path.read_text())
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
