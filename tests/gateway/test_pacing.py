"""The stream coalescing window (router.forwarding.pacing): its rule as a pure function,
then the Pacer measuring a loop thread through injected clocks."""

import asyncio
import logging
from collections.abc import Callable

import pytest

from router.common.blocking import WARN_EVERY_S
from router.forwarding.pacing import (
    BUSY,
    EASY,
    LATE_S,
    MIN_WINDOW_S,
    PERIOD_S,
    Pacer,
    busy_share,
    next_window,
)

MOST = 0.05


def test_an_idle_loop_has_no_window() -> None:
    assert next_window(0.0, 0.0, MOST) == 0.0
    assert next_window(0.0, EASY - 0.01, MOST) == 0.0


def test_a_busy_loop_opens_the_window_then_doubles_it_up_to_the_most() -> None:
    windows = [0.0]
    for _ in range(6):
        windows.append(next_window(windows[-1], BUSY, MOST))
    assert windows == [0.0, MIN_WINDOW_S, 0.01, 0.02, 0.04, MOST, MOST]


def test_one_busy_period_alone_opens_no_window() -> None:
    assert next_window(0.0, 1.0, MOST, busy_before=False) == 0.0
    assert next_window(0.0, 1.0, MOST, busy_before=True) == MIN_WINDOW_S
    assert next_window(0.01, 1.0, MOST, busy_before=False) == 0.02  # open: it widens


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
    clocks = Clocks()
    pacer = Pacer(MOST, wall=clocks.wall, on_change=heard.append)
    with caplog.at_level(logging.INFO, logger="router.forwarding.pacing"):
        for busy in (0.9, 0.9, 0.9, 0.5, 0.1, 0.1):
            pacer.observe(busy)
            clocks.tick(WARN_EVERY_S / 2)
    assert heard == [MIN_WINDOW_S, 0.01, MIN_WINDOW_S, 0.0]  # opened at the second
    assert pacer.window == 0.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "stream coalescing on, window 5 ms (event loop 90% busy)",
        "stream coalescing off (event loop 10% busy)",
    ]


def test_a_load_swinging_about_the_line_logs_at_most_a_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clocks = Clocks()
    pacer = Pacer(MOST, wall=clocks.wall)
    with caplog.at_level(logging.INFO, logger="router.forwarding.pacing"):
        for _ in range(150):  # on, off, on, ... for 15 s
            pacer.observe(0.9 if pacer.window == 0 else 0.1)
            clocks.tick(0.1)
    assert len(caplog.records) == 2  # at 0 s and at 10 s


def test_the_busy_share_is_the_cpu_share_or_busy_when_the_wake_up_came_late() -> None:
    assert busy_share(0.05, PERIOD_S) == pytest.approx(0.5)
    assert busy_share(0.0, PERIOD_S + LATE_S) == BUSY  # held off the CPU
    assert busy_share(0.1, PERIOD_S + LATE_S) == pytest.approx(1.0 / 1.05)


class Clocks:
    """A wall clock, and a CPU clock that runs at ``share`` of it."""

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

    def period(self) -> float:
        """As ``cpu``, a period on: Pacer.run reads it once a period, before
        the wall clock (which then shows a wake-up exactly on time)."""
        self.tick(PERIOD_S)
        return self._cpu


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.02)


async def test_run_opens_the_window_while_the_thread_is_busy_and_closes_it_after() -> None:
    clocks = Clocks()
    pacer = Pacer(MOST, cpu=clocks.period, wall=clocks.wall)
    task = asyncio.create_task(pacer.run())
    try:
        clocks.share = 0.95
        await until(lambda: pacer.window == MOST)
        clocks.share = 0.05
        await until(lambda: pacer.window == 0.0)
    finally:
        task.cancel()


async def test_run_with_no_most_returns_at_once() -> None:
    async with asyncio.timeout(5):
        await Pacer(0.0).run()
