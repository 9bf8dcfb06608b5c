"""The admission queue: requests wait for a replica instead of an instant 503.

A request for a model whose every replica is at ``profile.max_inflight``,
or for a model with ``autoscale`` and no routable replica (scaled to zero),
waits in the model's queue, bounded by ``queue.max_waiting`` (beyond: 503
``queue_full``), by ``queue.key_share`` of that for any one API key while
another key waits too (so a key that floods leaves room for the others: 503
``queue_full`` too; a key waiting alone may fill the queue) and
``queue.max_wait_s`` (beyond: 503 ``queue_timeout``, all with Retry-After).
Waiting requests are served in the order of router/admission/fair_queue.py (priority
class, then weighted fair on tokens) when a slot frees (a request of the
model ends) or the routing table changes (a replica appears), and never
overtaken by a newcomer: one is forwarded at once only while nobody waits.

A dispatched request holds its slot from the moment it is chosen until the
proxy counts it in flight (``pending``): the proxy picks the replica, this
layer only says when to go.

A model at zero replicas is woken once (router/admission/wake.py); a wake that fails
fails every request waiting for it, with one error id whose reason the log
and the admin API give (router/common/errors.py). A client that leaves
while waiting leaves the queue: answered 499, billed nothing, its quota
reservation released (its bill fails with no tokens: router/billing/bill.py).

``queue.max_waiting: 0`` turns the queue off for a model: today's 503.

Batch-class requests (``Priority.BATCH``: a batch's lines, sent by the
control worker with ``X-Llmgw-Priority: batch``) never take a slot an
interactive request could use: one starts only when more than
``queue.batch_headroom`` slots of the model are free, or when no
interactive request of the model waits or runs (``batch_may_go``). They
wait up to ``queue.batch_max_wait_s`` rather than ``max_wait_s``, are not
bound by ``key_share``, and count against ``max_waiting`` apart from the
interactive ones (a batch's backlog never fills the interactive queue). A
batch line for a model at zero wakes it like any request.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp

from llmgw.types import Priority, QueuePolicy, WakeResult
from router.admission.fair_queue import FairQueue
from router.admission.ticket import Forward, State, Ticket
from router.admission.waiting_stream import WaitingStream
from router.admission.wake import Waker
from router.billing.accounting import RequestOutcome
from router.billing.key_policy import KeyPolicy
from router.common.errors import ErrorKind, Incidents, OpenAIError, queue_timeout
from router.common.metrics import Metrics
from router.control_link.deployment_link import DeploymentLink
from router.control_link.load_report import LoadCounter
from router.control_link.routing import RoutingTable
from router.forwarding.call import Call

log = logging.getLogger(__name__)

# A model whose replicas have no in-flight cap is never full.
UNLIMITED = 1 << 30
# A safety net under the event-driven dispatch (request ends, table changes).
TICK_S = 0.5
# After a ready wake, the table is read again this soon while it lacks the replica.
TABLE_LAG_S = 0.1


def batch_may_go(free: int, headroom: int, interactive: int) -> bool:
    """Whether a batch-class request may take one of ``free`` slots: past the
    ``headroom`` kept for interactive requests, or any slot while no
    interactive request of the model (``interactive``: waiting or running) is
    there to want it."""
    return free > 0 and (free > headroom or interactive == 0)


def key_share(queue: QueuePolicy) -> int:
    """How many requests of one key may wait for a model: ``queue.key_share``
    of ``queue.max_waiting``, at least one."""
    return max(1, int(queue.max_waiting * queue.key_share))


@dataclass
class _Model:
    fair: FairQueue[Ticket] = field(default_factory=FairQueue)
    # Dispatched, not yet forwarded: slots promised to them.
    pending: int = 0
    # The model's queue policy as last seen (for the batch headroom at dispatch).
    queue: QueuePolicy = field(default_factory=QueuePolicy)


class Admission:
    """Per-model queues and their dispatch; the waking of models at zero."""

    def __init__(
        self,
        table: RoutingTable,
        metrics: Metrics,
        link: DeploymentLink | None,
        router_id: str,
        counter: LoadCounter | None = None,
        clock: Callable[[], float] = time.monotonic,
        incidents: Incidents | None = None,
    ) -> None:
        self._table = table
        # A failed wake's reason, for admins: clients get its error id.
        self.incidents = incidents or Incidents()
        self._metrics = metrics
        self.clock = clock
        self.counter = counter or LoadCounter()
        self.waker = Waker(link, router_id, self._woken, metrics, clock)
        self._models: dict[str, _Model] = {}
        self._kicked: set[str] = set()
        # Interactive (not batch-class) requests per model, waiting or running.
        self._interactive: dict[str, int] = {}
        # Streams that wait this long get a 200 and SSE comments while they wait.
        self.stream_quiet_s = 2.0
        self.stream_comment_s = 5.0
        metrics.watch_queues(self.depths)

    # -- what others read ------------------------------------------------

    def waiting(self, model: str) -> int:
        """Requests waiting for ``model`` now."""
        m = self._models.get(model)
        return len(m.fair) if m else 0

    def depths(self) -> dict[str, int]:
        """Waiting requests per model that had a queue (0 once it emptied)."""
        return {model: len(m.fair) for model, m in self._models.items()}

    def model_states(self) -> list[tuple[str, str]]:
        """(model, state) for ``/v1/models``: routable models ``ready``, and models
        with ``autoscale`` at zero replicas ``scaled-to-zero`` or ``waking``."""
        listed = [(m, "ready") for m in self._table.routable_models()]
        have = {m for m, _ in listed}
        for name, spec in self._table.specs.items():
            if spec.autoscale is not None and name not in have:
                listed.append((name, "waking" if self.waker.waking(name) else "scaled-to-zero"))
        return sorted(listed)

    # -- the request path ------------------------------------------------

    async def forward(
        self,
        call: Call,
        key_id: int,
        policy: KeyPolicy,
        cost: int,
        forward: Forward,
        queueable: bool = True,
        priority: Priority | None = None,
    ) -> ASGIApp:
        """Forward ``call`` now, or once a replica can take it; raises OpenAIError.

        ``priority`` overrides the key's class (the exec token's batch lines)."""
        priority = priority or Priority(policy.priority)
        batch = priority is Priority.BATCH
        self._count(call, batch)
        queue = self._queue_for(call.model, batch) if queueable else None
        if queue is None:
            return await forward()
        ticket = self._enqueue(call.model, key_id, policy, cost, queue, priority)
        max_wait_s = queue.batch_max_wait_s if batch else queue.max_wait_s
        deadline = ticket.enqueued + max_wait_s
        gone = asyncio.ensure_future(call.client_gone()) if call.client_gone else None
        try:
            if not call.stream:
                if not await self.wait(ticket, deadline, gone):
                    raise self.timed_out(ticket, max_wait_s)
                return await self.start(ticket, forward)
            quiet = min(deadline, ticket.enqueued + self.stream_quiet_s)
            if await self.wait(ticket, quiet, gone):
                return await self.start(ticket, forward)
            if quiet >= deadline:
                raise self.timed_out(ticket, max_wait_s)
        except BaseException:
            self.leave(ticket, "gone")
            raise
        finally:
            if gone is not None:
                gone.cancel()
        # A stream waiting longer: 200 now, comments while it waits (proxies
        # time out a silent connection), then the engine's events.
        return WaitingStream(self, ticket, deadline, max_wait_s, call, forward)

    def _queue_for(self, model: str, batch: bool = False) -> QueuePolicy | None:
        """The queue a request for ``model`` waits in; None: forward it now (a
        free slot and nobody ahead, or no replica and none to wake: 503). A
        batch-class request goes now only where ``batch_may_go``."""
        spec = self._table.specs.get(model)
        queue = spec.queue if spec is not None else QueuePolicy()
        if model in self._models:
            self._models[model].queue = queue
        if self._table.has_replicas(model):
            if not self.waiting(model):
                free = self._free(model)
                if not batch and free > 0:
                    return None
                interactive = self._interactive.get(model, 0)
                if batch and batch_may_go(free, queue.batch_headroom, interactive):
                    return None
        elif spec is not None and spec.autoscale is not None:
            self.waker.wake(model)
        else:
            return None
        return queue if queue.max_waiting > 0 else None

    async def wait(self, ticket: Ticket, until: float, gone: "asyncio.Future[None] | None") -> bool:
        """Until ``ticket`` is dispatched (True) or ``until`` passes (False, still
        waiting); raises 499 when the client left (out of the queue then) and
        the wake's error when the model could not be woken."""
        timeout = max(0.0, until - self.clock())
        waits: set[asyncio.Future[None]] = {ticket.future}
        if gone is not None:
            waits.add(gone)
        if not ticket.future.done():
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if ticket.future.done():
            ticket.future.result()  # raises a failed wake's error
            return True
        if gone is not None and gone.done() and not gone.cancelled():
            self.leave(ticket, "gone")
            raise ErrorKind.CLIENT_GONE.error()
        return False

    async def start(self, ticket: Ticket, forward: Forward) -> ASGIApp:
        """Forward a dispatched request: its slot passes to the proxy's count."""
        self._started(ticket)
        return await forward()

    def timed_out(self, ticket: Ticket, max_wait_s: float) -> OpenAIError:
        """Take a ticket out after its ``max_wait_s``; the error to answer."""
        self.leave(ticket, "timeout")
        return queue_timeout(ticket.model, max_wait_s)

    def leave(self, ticket: Ticket, reason: str) -> None:
        """Take a ticket out unserved (idempotent); a slot it held goes to the next."""
        m = self._models[ticket.model]
        if ticket.state is State.WAITING:
            assert ticket.entry is not None
            m.fair.remove(ticket.entry)
        elif ticket.state is State.DISPATCHED:
            m.pending -= 1
            self.kick(ticket.model)
        else:
            return
        ticket.state = State.LEFT
        if not ticket.future.done():
            ticket.future.cancel()
        self._metrics.queue_rejections.labels(ticket.model, reason).inc()
        self._observe(ticket)

    # -- dispatch ----------------------------------------------------------

    def kick(self, model: str | None = None) -> None:
        """Dispatch what can go (of ``model``, or every model), soon: slots free
        only once the proxy's own bookkeeping has run."""
        models = set(self._models) if model is None else {model}
        fresh = models - self._kicked
        if not fresh:
            return
        self._kicked |= fresh
        asyncio.get_running_loop().call_soon(self._run_kicked)

    def table_changed(self) -> None:
        """The routing table was rebuilt (router.control_link.routing's hook): replicas may
        have appeared; the waker learns which models are up again."""
        lagging = False
        for model, m in self._models.items():
            if self._table.has_replicas(model):
                self.waker.settled(model)
            elif len(m.fair) and self.waker.awaiting_table(model):
                lagging = True
        if lagging:
            # A woken replica not listed yet (visibility lags its ready):
            # look again shortly rather than a whole refresh interval later.
            asyncio.get_running_loop().call_later(TABLE_LAG_S, self._table.refresh_soon)
        if self._models:
            self.kick()

    async def run(self) -> None:
        """The safety-net dispatch, until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            if any(len(m.fair) for m in self._models.values()):
                self.kick()

    async def aclose(self) -> None:
        """Stop the wakes under way."""
        await self.waker.aclose()

    def _run_kicked(self) -> None:
        models, self._kicked = self._kicked, set()
        for model in models:
            self._dispatch(model)

    def _dispatch(self, model: str) -> None:
        m = self._models.get(model)
        if m is None or not len(m.fair) or not self._table.has_replicas(model):
            return
        free = self._free(model)
        while free > 0:
            if m.fair.depth(Priority.BATCH) == len(m.fair) and not batch_may_go(
                free, m.queue.batch_headroom, self._interactive.get(model, 0)
            ):
                break  # only batch waits: the headroom stays for interactive requests
            entry = m.fair.pop()
            if entry is None:
                break
            ticket = entry.item
            ticket.state = State.DISPATCHED
            m.pending += 1
            free -= 1
            ticket.future.set_result(None)

    def _free(self, model: str) -> int:
        """Slots free on the model's replicas, less those promised to dispatched requests."""
        all_routes = self._table.routes.get(model, [])
        if all_routes and all_routes[0].cap <= 0:
            return UNLIMITED  # every replica of a model has its catalog cap; 0: none
        # As RoutingTable.candidates picks (without turning its round-robin):
        # answering replicas, the recently failed ones only when all are.
        answering = [r for r in all_routes if r.answering]
        now = time.monotonic()
        routes = [r for r in answering if r.ejected_until <= now] or answering
        if any(r.cap <= 0 for r in routes):
            return UNLIMITED
        promised = self._models[model].pending if model in self._models else 0
        return sum(max(0, r.cap - r.inflight) for r in routes) - promised

    def _enqueue(
        self,
        model: str,
        key_id: int,
        policy: KeyPolicy,
        cost: int,
        queue: QueuePolicy,
        priority: Priority,
    ) -> Ticket:
        m = self._models.setdefault(model, _Model())
        m.queue = queue
        batch = priority is Priority.BATCH
        batches = m.fair.depth(Priority.BATCH)
        # Batch and interactive requests fill max_waiting apart.
        alike = batches if batch else len(m.fair) - batches
        if alike >= queue.max_waiting:
            self._metrics.queue_rejections.labels(model, "full").inc()
            raise ErrorKind.QUEUE_FULL.error(model=model, max_waiting=queue.max_waiting)
        share = key_share(queue)
        mine = m.fair.waiting_of(key_id)
        if not batch and mine >= share and len(m.fair) > mine:
            # One key floods while another waits: the rest of the queue stays
            # for the others (and the waiting it adds to the load reports, for
            # autoscale, stays within its share too). Alone, a key has the
            # whole queue: a single-key install loses nothing to the share.
            self._metrics.queue_rejections.labels(model, "key_share").inc()
            raise ErrorKind.KEY_QUEUE_FULL.error(model=model, share=share)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket = Ticket(model, self.clock(), future)
        ticket.entry = m.fair.push(ticket, key_id, cost, policy.weight, priority)
        # Capacity may have freed between the check and now (nothing awaited,
        # but a slot freed while others waited is theirs): dispatch in order.
        self.kick(model)
        return ticket

    def _started(self, ticket: Ticket) -> None:
        if ticket.state is not State.DISPATCHED:
            return
        self._models[ticket.model].pending -= 1
        ticket.state = State.STARTED
        self._observe(ticket)

    def _observe(self, ticket: Ticket) -> None:
        self._metrics.queue_wait.labels(ticket.model).observe(self.clock() - ticket.enqueued)

    def _count(self, call: Call, batch: bool = False) -> None:
        """Count the arrival, and on the request's end (once its bill is
        settled) its tokens, and free its slot; an interactive request is
        counted as present (for the batch headroom) until it ends."""
        model = call.model
        self.counter.arrived(model)
        if not batch:
            self._interactive[model] = self._interactive.get(model, 0) + 1

        def ended(outcome: RequestOutcome) -> None:
            self.counter.served(model, outcome.prompt_tokens + outcome.completion_tokens)
            if not batch:
                left = self._interactive[model] - 1
                if left:
                    self._interactive[model] = left
                else:
                    del self._interactive[model]
            if self.waiting(model):
                self.kick(model)

        call.bill.then(ended)

    def _woken(self, model: str, result: WakeResult) -> None:
        if result.ready:
            # Its replica is ready: the requests wait for the table to show it.
            self._table.refresh_soon()
            self.kick(model)
            return
        if self._table.has_replicas(model):
            return  # a replica came up another way: the queue drains as usual
        m = self._models.get(model)
        if m is None:
            return
        error = ErrorKind.WAKE_FAILED.error(
            model=model, reason=result.reason or "no reason given", incidents=self.incidents
        )
        while (entry := m.fair.pop()) is not None:
            ticket = entry.item
            ticket.state = State.LEFT
            ticket.future.set_exception(error)
            # Read here too: a waiter gone meanwhile would never read it.
            ticket.future.exception()
            self._metrics.queue_rejections.labels(model, "wake_failed").inc()
            self._observe(ticket)
