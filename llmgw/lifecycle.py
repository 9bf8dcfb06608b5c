"""Process plumbing shared by the long-running entry points.

Shutdown is bounded: a SIGTERM/SIGINT arms a watchdog that ends the process
``shutdown_timeout_s`` later whatever it is still waiting on (a Temporal
server that is frozen, a database that does not answer), so a supervisor or
an operator never waits on an llmgw process longer than that.
"""

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
# The status of a process its shutdown watchdog ended (timeout(1)'s).
WATCHDOG_EXIT = 124


def setup_logging(level: str, component: str) -> None:
    """Plain line logs on stderr, tagged with the component."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
    )
    httpx_log = logging.getLogger("httpx")
    if not any(isinstance(f, NoUrlQuery) for f in httpx_log.filters):
        httpx_log.addFilter(NoUrlQuery())
    # botocore.auth logs each signature it makes at DEBUG, a presigned URL's too.
    logging.getLogger("botocore.auth").setLevel(logging.INFO)


class NoUrlQuery(logging.Filter):
    """httpx logs every request's URL at INFO; a presigned URL's query (an
    s3:// file's GET, worker_agent/fetch/s3_origin.py) is a credential while
    it lasts, so the query is cut from the URLs httpx logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_no_query(arg) for arg in record.args)
        return True


def _no_query(arg: object) -> object:
    # httpx passes its URL object; duck-typed so this module needs no httpx.
    if type(arg).__name__ == "URL" and "?" in (text := str(arg)):
        return text.partition("?")[0] + "?(query hidden)"
    return arg


def exit_after(timeout_s: float) -> threading.Timer:
    """End the process ``timeout_s`` from now unless it has ended by then.

    A thread, not a loop callback: what a shutdown gets stuck on may hold the
    event loop, and ``asyncio.run`` itself waits for every worker thread (one
    blocked on a frozen database would keep the process alive forever).
    ``os._exit`` because a normal exit would wait for those same threads.
    """

    def expire() -> None:
        log.error("shutdown did not finish within %g s: exiting now", timeout_s)
        logging.shutdown()
        os._exit(WATCHDOG_EXIT)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer


class ShutdownWatchdog:
    """Arms :func:`exit_after` once, on the first stop signal."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        """Start counting down (a second call changes nothing)."""
        if self._timer is None and self.timeout_s > 0:
            self._timer = exit_after(self.timeout_s)


def stop_event_on_signals(shutdown_timeout_s: float = 0.0) -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, for a graceful shutdown.

    With ``shutdown_timeout_s`` the signal also arms the shutdown watchdog.
    """
    stop = asyncio.Event()
    watchdog = ShutdownWatchdog(shutdown_timeout_s)
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        watchdog.arm()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop


async def unless_stopped(stop: asyncio.Event, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None when ``stop`` is set first (``work`` is then
    cancelled): a start-up step waiting on an unreachable server must not
    delay a shutdown."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
