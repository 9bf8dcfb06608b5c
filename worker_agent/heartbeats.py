"""Heartbeating a long call while it runs in a thread."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from llmgw.types.shard import FetchProgressDetail

T = TypeVar("T")
D = TypeVar("D")

# Told what a long call is doing, while it does it (the activities pass
# Temporal's activity.heartbeat: a call that stops reporting is timed out).
Heartbeat = Callable[[str], None]
# A weights fetch's: its details are a FetchProgressDetail once bytes move.
FetchHeartbeat = Callable[[str | FetchProgressDetail], None]


async def beating_while(
    work: Awaitable[T], heartbeat: Callable[[D], None], detail: Callable[[], D]
) -> T:
    """Await blocking work run in a thread, heartbeating every second meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        heartbeat(detail())
        await asyncio.wait({task}, timeout=1.0)
    return task.result()
