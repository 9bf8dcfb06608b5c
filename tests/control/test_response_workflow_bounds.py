"""The background response workflow's bounds on a real Temporal dev server
(the fake router of tests/control/test_jobs_batch.py): a run that a router
keeps refusing (its 502 is retried, as a 429 or a lost router is) is given
up on after the retry policy's attempts, and the workflow ends ``failed``.
The policy's backoff is shortened here (its bound, not its intervals, is
under test: the workflow runs unsandboxed so that it reads the patched
policy); workflows/response_rules.py holds the shipped one."""

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.control.jobs import JobActivities
from activities.control.router_client import RouterClient
from llmgw import contracts
from llmgw.engine_keys import exec_token
from llmgw.queues import response_workflow_id
from llmgw.store import Store
from llmgw.types import ResponseRun
from tests.control.test_jobs_batch import KEY_ID, FakeRouter, serving
from tests.control.test_jobs_start import _response
from workflows import response_rules as rules
from workflows.jobs_response import BackgroundResponseWorkflow


async def test_a_run_refused_for_ever_is_given_up_on_and_ends_failed(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = RetryPolicy(
        initial_interval=timedelta(milliseconds=50),
        maximum_interval=timedelta(milliseconds=50),
        maximum_attempts=rules.MAX_ATTEMPTS,
    )
    monkeypatch.setattr(rules, "RUN_RETRY", fast)
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.migrate()
    fake = FakeRouter(store, exec_token(store.engine_key_secret(), KEY_ID), [], run_busy=10**6)

    async def secret() -> str:
        return store.engine_key_secret()

    try:
        async with serving(fake) as url:
            http = RouterClient([url], secret)
            jobs = JobActivities(store, http)
            queue = f"exec-test-{uuid.uuid4().hex[:8]}"
            worker = Worker(
                client, task_queue=queue, workflows=[BackgroundResponseWorkflow],
                activities=[jobs.run_response], workflow_runner=UnsandboxedWorkflowRunner(),
            )  # fmt: skip
            async with worker:
                response_id = _response(store)
                result = await contracts.RESPONSE.execute(
                    client, ResponseRun(response_id=response_id),
                    id=response_workflow_id(response_id), task_queue=queue,
                    execution_timeout=timedelta(seconds=120),
                )  # fmt: skip
            await http.aclose()
        assert result.status == "failed"
        assert fake.runs == [response_id] * rules.MAX_ATTEMPTS
    finally:
        store.close()
