"""Starting one process of a shard, and signalling and waiting on its group.

Whom it runs as (the engine user, unless that user cannot reach the
program), in which process group, with its output going where: the
supervisor decides which commands a shard has and records them; this module
only starts and stops processes.

A command's secret (the pass-through's keys) goes to it on its stdin, a pipe
the agent (root) made, wrote and closed before the start: never in the
environment, which ``/proc/<pid>/environ`` shows to every process of the
engine user however the program scrubs ``os.environ``. A pipe made by root is
root's and 0600, so no other process can open it again through
``/proc/<pid>/fd/0``.
"""

import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.errors import EngineLaunchError, EngineUserError
from worker_agent import procfs
from worker_agent.privileges import DROP_TO_ENV
from worker_agent.users import ALLOW_ROOT_HINT, RunAs, reachable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    """One process of a shard: its argv and its whole environment."""

    argv: list[str]
    env: Mapping[str, str]
    # The program becomes the engine user itself when told (the pass-through,
    # through DROP_TO_ENV): it is started as root, which also serves an
    # interpreter the user cannot read (under root's 0700 home). Only as an
    # isolated Python (``python -I``), in a root-owned working directory:
    # see user_for.
    drops_privileges: bool = False
    # Written to its stdin (then closed) before it starts; b"": stdin is /dev/null.
    stdin_secret: bytes = field(default=b"", repr=False)
    # Shown as its argv[0] (ps) instead of the program's path, which is still
    # what runs: a native engine's title (worker_agent/supervisor.py).
    title: str = ""


@dataclass(frozen=True)
class As:
    """How one command is started: by whom, where, with what added to its environment."""

    user: RunAs | None  # dropped to between fork and exec; None: the agent's user
    env: Mapping[str, str]
    # Its working directory is the engine user's home; False: the directory
    # the supervisor gives (the shard's, root's own and 0700).
    in_home: bool = False


def user_for(
    command: Command, run_as: RunAs | None, allow_root: bool, proxy: RunAs | None = None
) -> As:
    """Whom ``command`` runs as: the engine user, unless it cannot reach the program.

    A program that drops privileges itself (the pass-through, which holds
    the replica's key) starts as root and becomes the user on its own, after
    it read its key and made itself non-dumpable: started as that user, it
    would be every engine's to ptrace or read through /proc until it did.
    Only as ``python -I``, though: Python puts the script's or the working
    directory first on ``sys.path``, and the engine user writes its home, so
    ``python -m`` there would import that user's ``argparse.py`` as root.
    Isolated, nothing outside the interpreter's own paths is imported; it
    starts in the root-owned shard directory and enters the home only after
    it dropped to the user (privileges.drop_privileges). Anything else is refused.

    It drops to ``proxy`` where there is one (the pass-through user, not the
    engine user): an engine could otherwise signal or ptrace another
    replica's pass-through, its own uid, kill it and bind its port.
    """
    if run_as is None:
        return As(None, {})
    if command.drops_privileges:
        if command.argv[1:2] != ["-I"]:
            raise EngineUserError(
                f"{command.argv[:3]} is not an isolated Python (-I), and a program that "
                "drops privileges itself starts as root: refused"
            )
        who = proxy or run_as
        return As(None, {**who.env(), DROP_TO_ENV: who.drop_to()})
    program = Path(shutil.which(command.argv[0]) or command.argv[0]).resolve()
    if reachable(program, run_as.uid, run_as.groups):
        return As(run_as, run_as.env(), in_home=True)
    if not allow_root:
        raise EngineUserError(
            f"{run_as.user} cannot reach {program}: not starting it as root; {ALLOW_ROOT_HINT}"
        )
    log.warning("%s cannot reach %s: it runs as the agent's user (allowed)", run_as.user, program)
    return As(None, {})


def spawn(
    command: Command,
    how: As,
    cwd: Path,
    log_path: Path,
    pgid: int | None,
    marker: Mapping[str, str],
) -> subprocess.Popen[bytes]:
    """Start ``command`` as ``how`` says, in group ``pgid`` (None: a new group it
    leads), appending its output to ``log_path``; ``marker`` joins its environment."""
    user = how.user
    env = {**command.env, **how.env, **marker}
    # Opened by the agent and handed over as stdout: 0600 and the agent's,
    # so neither the engine user nor anyone else can read other shards' logs.
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "ab") as log_file, _secret_pipe(command.stdin_secret) as stdin:
        try:
            return subprocess.Popen(
                [command.title or command.argv[0], *command.argv[1:]],
                executable=command.argv[0],
                env=env,
                stdin=stdin,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=user.home if how.in_home and user else cwd,
                # The first command leads a new process group and the rest
                # join it, so one group signal stops the whole shard. (A
                # new session would be cleaner, but a process cannot join
                # a group in another session.)
                process_group=pgid or 0,
                # Dropped in the child between fork and exec: the engine
                # never runs a single instruction as root.
                user=user.uid if user else None,
                group=user.gid if user else None,
                extra_groups=list(user.groups) if user else None,
            )
        except OSError as exc:
            raise EngineLaunchError(f"cannot start {command.argv[0]}: {exc}") from exc


@contextlib.contextmanager
def _secret_pipe(secret: bytes) -> Iterator[int]:
    """A descriptor to give as stdin: a pipe holding ``secret`` with its write end
    closed (the reader sees it, then EOF), or /dev/null for no secret."""
    if not secret:
        fd = os.open(os.devnull, os.O_RDONLY)
    else:
        if len(secret) > select.PIPE_BUF:
            raise EngineLaunchError("a secret must fit a pipe's atomic write")
        fd, write_end = os.pipe()
        try:
            os.write(write_end, secret)
        finally:
            os.close(write_end)
    try:
        yield fd
    finally:
        os.close(fd)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to a process group; a group already gone is not an error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def wait_group_gone(pgid: int, child: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    """Whether, within ``timeout``, the group emptied and ``child`` was reaped."""
    deadline = time.monotonic() + timeout
    while True:
        # A multi-threaded leader shows as a zombie before its last
        # thread is gone and only then can be reaped: wait for both, or
        # its exit code is lost.
        reaped = child is None or child.poll() is not None
        if reaped and not procfs.group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
