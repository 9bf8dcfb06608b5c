"""The agent gives up its controlling terminal, so no engine it starts has one.

``llmgw agent`` run by hand in a root terminal would otherwise pass that
terminal on to every engine it forks: an engine (running as the engine user,
but with the terminal as its controlling tty) could open ``/dev/tty``, read
what root types there, or push input into it with ``TIOCSTI``. Engines are
forked with ``process_group`` (a session would forbid the shard's other
processes from joining the group), so they stay in the agent's session.

``setsid`` would drop the terminal, but it fails for a process-group leader,
which a shell with job control makes of every command it runs; ``TIOCNOTTY``
on ``/dev/tty`` works either way. For a process that is not the session
leader it detaches only that process: the shell keeps its terminal.
"""

import errno
import fcntl
import logging
import os
import signal
import termios

log = logging.getLogger(__name__)


def detach_terminal() -> bool:
    """Drop this process's controlling terminal, if it has one; whether it had.

    A session leader (``setsid -c``, ``script``) giving up its terminal
    hangs up its session's foreground group, the agent itself included at
    start: SIGHUP is ignored meanwhile (no engine runs yet to receive it).
    """
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno not in (errno.ENXIO, errno.ENOENT, errno.EACCES):
            log.warning("cannot open /dev/tty to give it up: %s", exc)
        return False  # no controlling terminal
    hangup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        fcntl.ioctl(fd, termios.TIOCNOTTY)
    finally:
        signal.signal(signal.SIGHUP, hangup)
        os.close(fd)
    log.info("gave up the controlling terminal: engines started from here have none")
    return True
