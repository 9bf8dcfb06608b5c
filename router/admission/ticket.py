"""A request's place in its model's admission queue (router/admission/queue.py),
and what it goes on to once a replica can take it.

Apart from the queue so that what the queue hands its waiting requests
(router/admission/waiting_stream.py) needs nothing of the queue's module.
"""

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.types import ASGIApp

from router.admission.fair_queue import Entry

# An answer as plain ASGI: router.forwarding.relay's Reply/StreamReply, or a WaitingStream.
Forward = Callable[[], Awaitable[ASGIApp]]


class State(enum.Enum):
    WAITING = "waiting"  # in the queue
    DISPATCHED = "dispatched"  # chosen; its slot is held until it is forwarded
    STARTED = "started"  # handed to the proxy
    LEFT = "left"  # gone unserved


@dataclass(eq=False)
class Ticket:
    """A request waiting for a replica of its model."""

    model: str
    enqueued: float
    future: asyncio.Future[None]
    state: State = State.WAITING
    entry: Entry["Ticket"] | None = None
