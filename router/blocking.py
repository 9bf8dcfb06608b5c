"""Blocking store calls from the event loop, in a thread: never abandoned
(``in_thread``, for writes that must land), or waited for within a bound
(``within``, on a request's path)."""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from llmgw.errors import StoreError

P = ParamSpec("P")
T = TypeVar("T")

# How long a call on a request's path waits for the store (LLMGW_STORE_WAIT_S).
STORE_WAIT_S = 2.0
# While the store is down every request's call fails: one warning per this long.
WARN_EVERY_S = 10.0


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


async def within(wait_s: float, fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread, waited for at most ``wait_s``: the store
    call on a request's path. A store that is frozen, unreachable or failing
    raises ``StoreError`` within that bound, whatever the driver does (a
    query on a frozen PostgreSQL blocks with no timeout of its own); the
    thread runs on and its late answer is dropped (``fn`` decides whether a
    late start still does anything)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn))
    work.add_done_callback(_retrieve)
    try:
        async with asyncio.timeout(wait_s):
            return await asyncio.shield(work)
    except TimeoutError:
        raise StoreError(f"no answer within {wait_s:g} s") from None
    except (SQLAlchemyError, OSError) as exc:
        raise StoreError(f"{type(exc).__name__}: {exc}") from exc


def _retrieve(work: "asyncio.Future[Any]") -> None:
    # A call given up on may fail later: its exception is nobody's to raise.
    if not work.cancelled():
        work.exception()


class Warnings:
    """A logger's warnings about a store that does not answer, at most one per
    ``WARN_EVERY_S`` (each request would log its own)."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._clock = clock
        self._at = -WARN_EVERY_S

    def warn(self, message: str, *args: object) -> None:
        now = self._clock()
        if now - self._at >= WARN_EVERY_S:
            self._at = now
            self._log.warning(message, *args)
