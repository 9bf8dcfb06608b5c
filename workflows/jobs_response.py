"""BackgroundResponse: one ``background: true`` response of ``/v1/responses``,
workflow id ``response/<id>``, queue ``exec``.

One RUN_RESPONSE activity has a router generate it (``POST
/internal/responses/{id}/run``): the router persists the events in flushes
and streams them back, and the activity heartbeats per event. A lost router,
a 5xx or a 429 is retried with backoff, on whichever router answers: the
retry continues from the stored events. Retries are bounded: the router
fails a response past its attempts or its deadline (router/responses/bounds.py),
and the activity itself has a cap on attempts and an execution timeout
(workflows/response_rules.py) for attempts that never reach a router. The
CANCEL_RESPONSE signal gives the router a moment to see the response's
``cancel_requested_at`` at its next flush and end it (status cancelled),
then cancels the activity. The status goes to the search attribute
``ResponseStatus``; the events and output live in the store, never in the
history (about six events per response).
"""

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw import search_attributes as sa
    from llmgw.types import CancelJob, ResponseRun, ResponseRunResult
    from workflows import response_rules as rules

# The activity heartbeats every 2 s at least, and per persisted event.
HEARTBEAT = timedelta(seconds=15)
# How long a cancelled response's router has to end it itself.
CANCEL_GRACE = timedelta(seconds=10)


@workflow.defn(name=contracts.RESPONSE.name)
class BackgroundResponseWorkflow:
    """Run one background response to its end."""

    def __init__(self) -> None:
        self._cancel = False

    @workflow.signal(name=contracts.CANCEL_RESPONSE.name)
    def cancel(self, _: CancelJob) -> None:
        """The router's cancel (the row's cancel_requested_at is set already)."""
        self._cancel = True

    @workflow.run
    async def run(self, run: ResponseRun) -> ResponseRunResult:
        """Generate ``run.response_id`` through a router."""
        workflow.upsert_search_attributes([sa.RESPONSE_STATUS.value_set("in_progress")])
        task: asyncio.Task[ResponseRunResult] = workflow.start_activity(
            contracts.RUN_RESPONSE.name,
            run,
            result_type=ResponseRunResult,
            start_to_close_timeout=rules.ATTEMPT_TIMEOUT,
            schedule_to_close_timeout=rules.EXECUTION_TIMEOUT,
            heartbeat_timeout=HEARTBEAT,
            retry_policy=rules.RUN_RETRY,
        )
        cancel: asyncio.Task[Any] = asyncio.create_task(
            workflow.wait_condition(lambda: self._cancel)
        )
        await workflow.wait([task, cancel], return_when=asyncio.FIRST_COMPLETED)
        cancel.cancel()
        if not task.done():
            try:
                await workflow.wait_condition(task.done, timeout=CANCEL_GRACE)
            except TimeoutError:
                task.cancel()
                await workflow.wait([task])
        ran = task.done() and not task.cancelled()
        # Given up on: past its attempts or its execution timeout.
        failed = ran and task.exception() is not None and not self._cancel
        result = task.result() if ran and task.exception() is None else ResponseRunResult()
        status = rules.final_status(ran and task.exception() is None, failed, result.status)
        result = result.model_copy(update={"status": status})
        workflow.upsert_search_attributes([sa.RESPONSE_STATUS.value_set(status)])
        return result
