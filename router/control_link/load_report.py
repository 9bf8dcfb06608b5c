"""This router's load per model, reported to the models' deployments.

Requests only bump counters here (no I/O, no await). A background task
sends one :class:`LoadReport` per model with load at most once per
interval (1 s), and one report of zero when the load stops, so the
deployment's sum drops at once rather than when this router's report
expires. Only models with ``autoscale`` are reported: their deployments are
the ones that listen. A failed report is logged and dropped: the next one
carries the then current load anyway.
"""

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from llmgw.types import LoadReport, ModelLoad
from router.control_link.deployment_link import DeploymentLink
from router.control_link.routing import RoutingTable

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0


class LoadCounter:
    """Arrivals and tokens per model since the last report."""

    def __init__(self) -> None:
        self._arrivals: defaultdict[str, int] = defaultdict(int)
        self._tokens: defaultdict[str, int] = defaultdict(int)

    def arrived(self, model: str) -> None:
        """A request for ``model`` arrived."""
        self._arrivals[model] += 1

    def served(self, model: str, tokens: int) -> None:
        """A request for ``model`` ended, accounting ``tokens``."""
        if tokens > 0:
            self._tokens[model] += tokens

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """Arrivals and tokens per model since the last take; the counters restart."""
        arrivals, tokens = dict(self._arrivals), dict(self._tokens)
        self._arrivals.clear()
        self._tokens.clear()
        return arrivals, tokens


def loads(
    table: RoutingTable,
    waiting: Callable[[str], int],
    arrivals: dict[str, int],
    tokens: dict[str, int],
    reported: set[str],
    interval_s: float,
) -> list[ModelLoad]:
    """The loads to report: each autoscaled model with load, and each one that
    had load in the last report (now zero). ``reported`` is updated in place
    to the models reported with load."""
    out: list[ModelLoad] = []
    for model, spec in table.specs.items():
        if spec.autoscale is None:
            continue
        load = ModelLoad(
            model=model,
            inflight=sum(r.inflight for r in table.routes.get(model, [])),
            waiting=waiting(model),
            arrivals=arrivals.get(model, 0),
            tokens=tokens.get(model, 0),
            interval_s=max(interval_s, 1e-3),
        )
        busy = bool(load.inflight or load.waiting or load.arrivals or load.tokens)
        if busy or model in reported:
            out.append(load)
        if busy:
            reported.add(model)
        else:
            reported.discard(model)
    return out


class LoadReporter:
    """Sends this router's loads in the background."""

    def __init__(
        self,
        table: RoutingTable,
        counter: LoadCounter,
        waiting: Callable[[str], int],
        link: DeploymentLink,
        router_id: str,
        interval_s: float = REPORT_INTERVAL_S,
    ) -> None:
        self._table = table
        self._counter = counter
        self._waiting = waiting
        self._link = link
        self._router_id = router_id
        self._interval_s = interval_s
        self._reported: set[str] = set()
        self._failing: set[str] = set()

    async def run(self) -> None:
        """Report every interval until cancelled."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self._interval_s)
            now = time.monotonic()
            await self.report_once(now - last)
            last = now

    async def report_once(self, interval_s: float) -> None:
        """One round: a report per model with load (or just without), sent together."""
        arrivals, tokens = self._counter.take()
        batch = loads(self._table, self._waiting, arrivals, tokens, self._reported, interval_s)
        if batch:
            await asyncio.gather(*(self._send(load) for load in batch))

    async def _send(self, load: ModelLoad) -> None:
        try:
            await self._link.report(load.model, LoadReport(router_id=self._router_id, load=load))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Once per model until a report goes through: a model whose
            # deployment is missing would log every second otherwise.
            if load.model not in self._failing:
                self._failing.add(load.model)
                log.warning("load reports for %s dropped: %s", load.model, exc)
            return
        self._failing.discard(load.model)
