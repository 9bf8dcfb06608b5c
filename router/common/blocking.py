"""Blocking store calls from the event loop, in a thread, waited for within
a bound (``within``, on a request's path). Writes that must land are never
abandoned: router/billing/usage_batches.py and router/billing/accounting.py keep their
thread's future and wait for it again at the next flush."""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from llmgw.errors import StoreError

T = TypeVar("T")

# How long a call on a request's path waits for the store (LLMGW_STORE_WAIT_S).
STORE_WAIT_S = 2.0
# While the store is down every request's call fails: one warning per this long.
WARN_EVERY_S = 10.0


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
    """A logger's lines about a condition that every request (or every
    period) would report, at most one per ``WARN_EVERY_S``: a store that does
    not answer, a load swinging about a threshold."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._clock = clock
        self._at = -WARN_EVERY_S

    def warn(self, message: str, *args: object) -> None:
        self._line(logging.WARNING, message, args)

    def info(self, message: str, *args: object) -> None:
        self._line(logging.INFO, message, args)

    def _line(self, level: int, message: str, args: tuple[object, ...]) -> None:
        now = self._clock()
        if now - self._at >= WARN_EVERY_S:
            self._at = now
            self._log.log(level, message, *args)
