"""Load-adaptive coalescing of relayed streams (LLMGW_STREAM_COALESCE_MAX_S).

A stream is relayed read by read: each engine read, one write to the
client (router.forwarding.relay.Pour). At tens of thousands of events a second that
is most of the router's one event loop: per event a read, a write and
their share of epoll in the kernel, and the callbacks around them. A loop
that busy serves a new request late at each of its steps, so the first
token of every new stream waits on the tokens of the streams already
running (``python -m tests.bench.bench_streams``: 1,000 streams of one
token per 10 ms added ~40 ms to a new stream's first token).

So while the loop is busy, an established stream's engine connection is
read at most once per ``window``: after a relayed read it stops being
read for that long, the engine's next events wait in the kernel's socket
buffer, and they go to the client as one write. A stream's first event is
never held, only those after it, by at most the window; the cost per event
falls with the events each read brings. An idle loop has no window: each
read is relayed as it comes, as before.

The window follows the share of wall time the loop's thread spends on the
CPU, measured every ``PERIOD_S`` (a period whose wake-up comes ``LATE_S``
late counts as busy: a thread held off the CPU is as slow to serve as a
busy one): at ``BUSY`` or more (two periods in a row to open it) it doubles (from
``MIN_WINDOW_S``, up to the configured most), below ``EASY`` it halves
(below ``MIN_WINDOW_S``: none). Between the two it holds, so a window that
brought the loop back under ``BUSY`` stays rather than swinging.
"""

import asyncio
import logging
import time
from collections.abc import Callable

from router.common.blocking import Warnings

log = logging.getLogger(__name__)

PERIOD_S = 0.1
BUSY = 0.7
EASY = 0.35
MIN_WINDOW_S = 0.005
# A period's wake-up this late counts as busy (busy_share).
LATE_S = 0.005
# The default most a relayed event is held (LLMGW_STREAM_COALESCE_MAX_S).
MAX_WINDOW_S = 0.05


def next_window(window: float, busy: float, most: float, busy_before: bool = True) -> float:
    """The window for the next period, given this one's, the loop's busy share
    and whether the period before was busy too: a window opens only after two
    busy periods in a row, not on one spike (a start-up, a collection)."""
    if most <= 0:
        return 0.0
    if busy >= BUSY:
        if not window and not busy_before:
            return 0.0
        return min(most, max(MIN_WINDOW_S, window * 2))
    if busy < EASY:
        half = window / 2
        return half if half >= MIN_WINDOW_S else 0.0
    return min(window, most)


def busy_share(cpu_s: float, wall_s: float) -> float:
    """A period's busy share: the loop thread's CPU time over the wall time,
    or ``BUSY`` at least when the period's wake-up came ``LATE_S`` late. A
    thread kept off the CPU (a container's CPU quota spent, a VM's stolen
    time, other processes) shows little CPU time, yet serves requests late."""
    share = cpu_s / wall_s
    return max(share, BUSY) if wall_s - PERIOD_S >= LATE_S else share


class Pacer:
    """The current coalescing window (``window``, seconds; 0: none), kept by ``run``.

    ``cpu`` and ``wall`` are the clocks it compares (the loop thread's CPU
    time and a monotonic clock); ``on_change`` hears each new window.
    """

    def __init__(
        self,
        most_s: float = MAX_WINDOW_S,
        cpu: Callable[[], float] = time.thread_time,
        wall: Callable[[], float] = time.perf_counter,
        on_change: Callable[[float], None] | None = None,
    ) -> None:
        self.window = 0.0
        self.most = most_s
        self._cpu = cpu
        self._wall = wall
        self._on_change = on_change
        self._lines = Warnings(log, wall)
        self._was_busy = False

    def observe(self, busy: float) -> float:
        """Take one period's busy share; the window from now on."""
        window = next_window(self.window, busy, self.most, self._was_busy)
        self._was_busy = busy >= BUSY
        if window != self.window:
            if not self.window or not window:
                # Engaged or let go: a line, not one per doubling, and at most
                # one per WARN_EVERY_S under a load that swings about the line.
                self._lines.info(
                    "stream coalescing %s (event loop %.0f%% busy)",
                    f"on, window {window * 1e3:.0f} ms" if window else "off",
                    busy * 100,
                )
            self.window = window
            if self._on_change is not None:
                self._on_change(window)
        return window

    async def run(self) -> None:
        """Measure the loop thread every ``PERIOD_S`` and keep the window (runs
        on the loop's thread: the thread whose CPU time it reads)."""
        if self.most <= 0:
            return
        cpu, wall = self._cpu(), self._wall()
        while True:
            await asyncio.sleep(PERIOD_S)
            cpu2, wall2 = self._cpu(), self._wall()
            if wall2 > wall:
                self.observe(busy_share(cpu2 - cpu, wall2 - wall))
            cpu, wall = cpu2, wall2
