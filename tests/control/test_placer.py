"""Placement requests coalesce into batches, each caller gets its own answer."""

import asyncio

import pytest

from activities.control.placer import Placer
from llmgw.types import (
    ModelSpec,
    PlaceBatch,
    PlaceBatchResult,
    Placement,
    PlaceRequest,
    PlaceResult,
)

MODEL = ModelSpec(name="m", source="/m")


def request(i: int) -> PlaceRequest:
    return PlaceRequest(replica_id=f"r{i}", model=MODEL)


class FakeFleet:
    """Answers each request with a placement on a node named after it; a
    batch waits on ``gate`` so that callers pile up behind it."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.fail: Exception | None = None

    async def send(self, batch: PlaceBatch) -> PlaceBatchResult:
        self.batches.append([r.replica_id for r in batch.requests])
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return PlaceBatchResult(
            results=[
                PlaceResult(
                    placement=Placement(replica_id=r.replica_id, model="m", node_id=r.replica_id)
                )
                for r in batch.requests
            ]
        )


async def test_requests_made_while_a_batch_is_in_flight_go_together() -> None:
    fleet = FakeFleet()
    placer = Placer(fleet.send, max_in_flight=1, max_batch=4)
    calls = [asyncio.ensure_future(placer.place(request(0)))]
    while not fleet.batches:  # r0 is in flight, alone
        await asyncio.sleep(0)
    calls += [asyncio.ensure_future(placer.place(request(i))) for i in range(1, 7)]
    await asyncio.sleep(0)
    fleet.gate.set()
    answers = await asyncio.gather(*calls)
    assert [a.placement.node_id for a in answers if a.placement] == [f"r{i}" for i in range(7)]
    assert fleet.batches == [["r0"], ["r1", "r2", "r3", "r4"], ["r5", "r6"]]


async def test_a_failed_batch_fails_each_of_its_callers() -> None:
    fleet = FakeFleet()
    fleet.fail = RuntimeError("fleet unreachable")
    fleet.gate.set()
    placer = Placer(fleet.send)
    calls = [placer.place(request(i)) for i in range(3)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    fleet.fail = None
    # The placer still works afterwards.
    answer = await placer.place(request(9))
    assert answer.placement is not None and answer.placement.node_id == "r9"


async def test_a_short_answer_is_an_error_not_a_misattribution() -> None:
    async def short(batch: PlaceBatch) -> PlaceBatchResult:
        return PlaceBatchResult(results=[])

    with pytest.raises(RuntimeError, match="answered 0 of 1"):
        await Placer(short).place(request(0))
