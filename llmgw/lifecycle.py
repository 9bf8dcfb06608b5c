"""Process plumbing shared by the long-running entry points."""

import asyncio
import logging
import signal


def setup_logging(level: str, component: str) -> None:
    """Plain line logs on stderr, tagged with the component."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
    )


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, for a graceful shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
