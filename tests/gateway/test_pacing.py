"""The stream coalescing window (router.pacing): its rule as a pure function,
then the Pacer measuring a loop thread through injected clocks."""

import asyncio
import logging
from collections.abc import Callable

import pytest

from router.pacing import BUSY, EASY, MIN_WINDOW_S, Pacer, next_window

MOST = 0.05


def test_an_idle_loop_has_no_window() -> None:
    assert next_window(0.0, 0.0, MOST) == 0.0
    assert next_window(0.0, EASY - 0.01, MOST) == 0.0


def test_a_busy_loop_opens_the_window_then_doubles_it_up_to_the_most() -> None:
    windows = [0.0]
    for _ in range(6):
        windows.append(next_window(windows[-1], BUSY, MOST))
    assert windows == [0.0, MIN_WINDOW_S, 0.01, 0.02, 0.04, MOST, MOST]


def test_between_easy_and_busy_the_window_holds() -> None:
    middle = (EASY + BUSY) / 2
    assert next_window(0.02, middle, MOST) == 0.02
    assert next_window(0.0, middle, MOST) == 0.0


def test_an_easy_loop_halves_the_window_and_closes_it_below_the_least() -> None:
    windows = [MOST]
    while windows[-1]:
        windows.append(next_window(windows[-1], EASY / 2, MOST))
    assert windows == [MOST, 0.025, 0.0125, 0.00625, 0.0]


def test_no_most_means_no_window_however_busy() -> None:
    assert next_window(0.0, 1.0, 0.0) == 0.0
    assert next_window(0.04, 1.0, 0.0) == 0.0  # lowered while one was open


def test_a_lowered_most_caps_a_held_window() -> None:
    assert next_window(0.04, (EASY + BUSY) / 2, 0.01) == 0.01


def test_observe_reports_each_new_window_and_logs_only_on_and_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: list[float] = []
    pacer = Pacer(MOST, on_change=heard.append)
    with caplog.at_level(logging.INFO, logger="router.pacing"):
        for busy in (0.9, 0.9, 0.45, 0.1, 0.1):
            pacer.observe(busy)
    assert heard == [MIN_WINDOW_S, 0.01, MIN_WINDOW_S, 0.0]
    assert pacer.window == 0.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "stream coalescing on, window 5 ms (event loop 90% busy)",
        "stream coalescing off (event loop 10% busy)",
    ]


class Clocks:
    """A wall clock and a CPU clock that runs at ``share`` of it."""

    def __init__(self) -> None:
        self.share = 0.0
        self._wall = 0.0
        self._cpu = 0.0

    def wall(self) -> float:
        return self._wall

    def cpu(self) -> float:
        return self._cpu

    def tick(self, seconds: float) -> None:
        self._wall += seconds
        self._cpu += seconds * self.share


async def wait_for(check: Callable[[], bool], clocks: Clocks) -> None:
    """Advance the fake clocks a period at a time until ``check()`` holds."""
    async with asyncio.timeout(10):
        while not check():
            clocks.tick(0.1)
            await asyncio.sleep(0.02)


async def test_run_opens_the_window_while_the_thread_is_busy_and_closes_it_after() -> None:
    clocks = Clocks()
    pacer = Pacer(MOST, cpu=clocks.cpu, wall=clocks.wall)
    task = asyncio.create_task(pacer.run())
    try:
        clocks.share = 0.95
        await wait_for(lambda: pacer.window == MOST, clocks)
        clocks.share = 0.05
        await wait_for(lambda: pacer.window == 0.0, clocks)
    finally:
        task.cancel()


async def test_run_with_no_most_returns_at_once() -> None:
    async with asyncio.timeout(5):
        await Pacer(0.0).run()
