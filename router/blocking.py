"""Blocking store calls from the event loop: in a thread, and never abandoned."""

import asyncio
import contextlib
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def in_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn`` in a worker thread. Cancelling the caller still waits for the
    thread to finish (a thread cannot be stopped): a shutdown that cancels a
    flush must not close the store under a write that is still running."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await work
        raise
