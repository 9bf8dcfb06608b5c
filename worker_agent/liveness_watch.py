"""A watch's liveness probing, as a task beside the watch (worker_agent/shard_service.py).

The decision is worker_agent/liveness.py's (pure); this runs the probe
rounds: at most one in flight, never holding up the watch's process checks.
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from worker_agent.liveness import Hung, Liveness, LivenessRules, Observation, Suspect


class LivenessWatch:
    """A watch's liveness probing: at most one probe round in flight, run as
    its own task so that a probe waiting on a frozen engine never holds up
    the watch's process checks and heartbeats; each round's answer goes to
    the verdict (worker_agent/liveness.py) when the watch next looks."""

    def __init__(self, rules: LivenessRules, ask: Callable[[str], Awaitable[Observation]]) -> None:
        self._rules = rules
        self._ask = ask
        self._state = Liveness(rules)
        self._loop = asyncio.get_running_loop()
        # The engine was just found ready (or adopted): first round after an interval.
        self._next = self._loop.time() + rules.interval_s
        # A round in flight: when it was asked, and its answer.
        self._round: asyncio.Task[tuple[float, Observation]] | None = None
        self._verdict: Suspect | Hung | None = None

    def step(self, endpoint: str) -> Suspect | Hung | None:
        """Take a finished round's answer and start the next when due; the
        verdict so far (None: alive)."""
        now = self._loop.time()
        if self._round is not None and self._round.done():
            asked, seen = self._round.result()
            self._round = None
            verdict = self._state.observe(seen, now, asked)
            self._verdict = verdict if isinstance(verdict, Suspect | Hung) else None
        if self._round is None and now >= self._next and not isinstance(self._verdict, Hung):
            self._round = asyncio.ensure_future(self._timed(endpoint, now))
            self._next = now + self._rules.interval_s
        return self._verdict

    async def _timed(self, endpoint: str, started: float) -> tuple[float, Observation]:
        try:
            return started, await self._ask(endpoint)
        except Exception as exc:
            # A probe's own fault (an endpoint httpx refuses, a pool error) is
            # an unanswered round, never the watch's end.
            return started, Observation(answered=False, why=f"{type(exc).__name__}: {exc}")

    async def aclose(self) -> None:
        """Drop a round in flight (the watch ended), and wait until it has."""
        if self._round is not None:
            self._round.cancel()
            with contextlib.suppress(BaseException):
                await self._round
            self._round = None
