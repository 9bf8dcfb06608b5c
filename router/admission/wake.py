"""Waking a model scaled to zero: once per model in this router, in the background.

However many requests arrive for a model at zero replicas, this router sends
one ``wake`` (single flight); the deployment makes it idempotent across
routers. The requests wait in the admission queue meanwhile and are
dispatched when the routing table shows a ready replica; a wake answered
``ready=False`` fails them with its reason (router/admission/queue.py).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from llmgw.types import WakeInput, WakeResult
from router.common.metrics import Metrics
from router.control_link.deployment_link import DeploymentLink

log = logging.getLogger(__name__)

# After a wake answered ready, the routing table may lag by a refresh: new
# requests in that time wait for it rather than wake again.
READY_HOLD_S = 10.0

WakeCallback = Callable[[str, WakeResult], None]


class Waker:
    """Single-flight wakes per model."""

    def __init__(
        self,
        link: DeploymentLink | None,
        router_id: str,
        on_result: WakeCallback,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._link = link
        self._router_id = router_id
        self._on_result = on_result
        self._metrics = metrics
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ready_until: dict[str, float] = {}

    def waking(self, model: str) -> bool:
        """Whether a wake of ``model`` is under way (or just answered ready)."""
        return model in self._tasks or self._ready_until.get(model, 0.0) > self._clock()

    def wake(self, model: str) -> None:
        """Ask the deployment of ``model`` to wake, unless a wake is under way."""
        if self.waking(model):
            return
        self._ready_until.pop(model, None)
        self._tasks[model] = asyncio.create_task(self._wake(model), name=f"wake {model}")

    async def _wake(self, model: str) -> None:
        started = self._clock()
        try:
            if self._link is None:
                result = WakeResult(
                    ready=False, reason="this router has no Temporal client to wake it"
                )
            else:
                log.info("waking %s", model)
                result = await self._link.wake(model, WakeInput(router_id=self._router_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("wake of %s failed: %s", model, exc)
            result = WakeResult(ready=False, reason=f"the wake failed: {exc}")
        finally:
            self._tasks.pop(model, None)
        outcome = "ready" if result.ready else "failed"
        self._metrics.wakes.labels(model, outcome).inc()
        log.info(
            "wake of %s: %s after %.2f s %s",
            model, outcome, self._clock() - started, result.reason,
        )  # fmt: skip
        if result.ready:
            self._ready_until[model] = self._clock() + READY_HOLD_S
        self._on_result(model, result)

    def awaiting_table(self, model: str) -> bool:
        """Whether a wake of ``model`` answered ready and the routing table
        does not show its replica yet."""
        return model not in self._tasks and self._ready_until.get(model, 0.0) > self._clock()

    def settled(self, model: str) -> None:
        """The routing table shows a replica of ``model``: the next zero wakes again."""
        self._ready_until.pop(model, None)

    async def aclose(self) -> None:
        """Cancel the wakes under way (the router is stopping)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
