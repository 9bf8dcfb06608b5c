"""A process on a host of the bed, and the signals that fault it."""

import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw_cli.procs import signal_group
from tests.cluster.names import MARKER


@dataclass
class HostProcess:
    """One process started in a host's namespace, in its own process group.

    The signals go to the whole group, so what the process forks is faulted
    with it, as a host's crash or freeze would.
    """

    host: str
    argv: list[str]
    popen: subprocess.Popen[bytes] = field(repr=False)

    @property
    def pid(self) -> int:
        """The process's pid (also its process group id)."""
        return self.popen.pid

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process group (nothing if it is gone, or reaped)."""
        signal_group(self.popen, sig)

    def kill(self) -> None:
        """SIGKILL, the crash fault: no handler runs."""
        self.signal(signal.SIGKILL)

    def freeze(self) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        self.signal(signal.SIGCONT)

    def alive(self) -> bool:
        """Whether the process has not exited (a frozen one is alive)."""
        return self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit status.

        SIGCONT first: a frozen process would not act on SIGTERM.
        """
        if self.alive():
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)
            try:
                return self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.popen.wait(10)


def spawn(
    host: str,
    ns: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path | None,
    log: Path | None,
) -> HostProcess:
    """Start ``argv`` in namespace ``ns`` with exactly ``env`` (plus the marker).

    ``ip netns exec`` execs the command, so the pid is the command's own.
    Settings and secrets go in ``env`` or files, never in ``argv``, which
    every user of the machine can read.
    """
    out = log.open("ab") if log else subprocess.DEVNULL
    try:
        popen = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            env={**env, MARKER: ns},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        if log and not isinstance(out, int):
            out.close()
    return HostProcess(host, list(argv), popen)
