"""Placement requests to the fleet, coalesced into batch updates.

Every replica start asks the fleet for a place, and the fleet is one
workflow: one update each costs a workflow task each (tens of ms on a busy
server), and the server admits only a few updates to one workflow at a time.
Requests that arrive while earlier ones are in flight are sent together as
one ``place_batch`` update, decided in arrival order in one workflow task, so
the fleet's throughput grows with the load instead of queueing behind it.
The fleet decides each request exactly as a lone ``place`` would.
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from temporalio.client import Client

from llmgw import contracts
from llmgw.queues import FLEET_WORKFLOW_ID
from llmgw.types import PlaceBatch, PlaceBatchResult, PlaceRequest, PlaceResult

SendBatch = Callable[[PlaceBatch], Awaitable[PlaceBatchResult]]
# Batches in flight at once: below the server's limit on in-flight updates
# per workflow (10 by default), leaving room for release and cordon.
MAX_IN_FLIGHT = 2
MAX_BATCH = 200  # bounds one update's payload and one workflow task's work


def fleet_sender(client: Client) -> SendBatch:
    """Send a batch as one update to the fleet workflow."""

    async def send(batch: PlaceBatch) -> PlaceBatchResult:
        handle = client.get_workflow_handle(FLEET_WORKFLOW_ID)
        return await contracts.PLACE_BATCH.execute(handle, batch)

    return send


class Placer:
    """Coalesces concurrent ``place`` calls into ``place_batch`` updates."""

    def __init__(
        self, send: SendBatch, max_in_flight: int = MAX_IN_FLIGHT, max_batch: int = MAX_BATCH
    ) -> None:
        self._send = send
        self._max_batch = max_batch
        self._slots = asyncio.Semaphore(max_in_flight)
        self._queue: list[tuple[PlaceRequest, asyncio.Future[PlaceResult]]] = []
        self._pump: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def place(self, request: PlaceRequest) -> PlaceResult:
        """The fleet's answer to ``request``, sent with whatever else is waiting."""
        answer = asyncio.get_running_loop().create_future()
        self._queue.append((request, answer))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._send_waiting())
        return await asyncio.shield(answer)

    async def _send_waiting(self) -> None:
        while self._queue:
            await self._slots.acquire()
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            if not batch:
                self._slots.release()
                return
            task = asyncio.create_task(self._send_one(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_one(
        self, batch: list[tuple[PlaceRequest, asyncio.Future[PlaceResult]]]
    ) -> None:
        try:
            result = await self._send(PlaceBatch(requests=[r for r, _ in batch]))
            if len(result.results) != len(batch):
                raise RuntimeError(
                    f"fleet answered {len(result.results)} of {len(batch)} placements"
                )
        except BaseException as err:  # every caller of the batch learns why
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(err)
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        finally:
            self._slots.release()
        for (_, answer), placed in zip(batch, result.results, strict=True):
            if not answer.done():
                answer.set_result(placed)

    async def aclose(self) -> None:
        """Wait for the batches in flight (their callers still get answers)."""
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._sending)
