"""Starting one process of a shard, and signalling and waiting on its group.

Whom it runs as (the engine user, unless that user cannot reach the
program), in which process group, with its output going where: the
supervisor decides which commands a shard has and records them; this module
only starts and stops processes.
"""

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import EngineLaunchError, EngineUserError
from worker_agent import procfs
from worker_agent.users import ALLOW_ROOT_HINT, DROP_TO_ENV, RunAs, reachable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    """One process of a shard: its argv and its whole environment."""

    argv: list[str]
    env: Mapping[str, str]
    # The program becomes the engine user itself when told (the pass-through,
    # through DROP_TO_ENV): it may be started as root when that user cannot
    # read it (an interpreter under root's 0700 home).
    drops_privileges: bool = False


@dataclass(frozen=True)
class As:
    """How one command is started: by whom, where, with what added to its environment."""

    user: RunAs | None  # dropped to between fork and exec; None: the agent's user
    home: RunAs | None  # whose home is its cwd and HOME
    env: Mapping[str, str]


def user_for(command: Command, run_as: RunAs | None, allow_root: bool) -> As:
    """Whom ``command`` runs as: the engine user, unless it cannot reach the program."""
    if run_as is None:
        return As(None, None, {})
    program = Path(shutil.which(command.argv[0]) or command.argv[0]).resolve()
    if reachable(program, run_as.uid, run_as.groups):
        return As(run_as, run_as, run_as.env())
    if command.drops_privileges:
        return As(None, run_as, {**run_as.env(), DROP_TO_ENV: run_as.drop_to()})
    if not allow_root:
        raise EngineUserError(
            f"{run_as.user} cannot reach {program}: not starting it as root; {ALLOW_ROOT_HINT}"
        )
    log.warning("%s cannot reach %s: it runs as the agent's user (allowed)", run_as.user, program)
    return As(None, None, {})


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
    with os.fdopen(fd, "ab") as log_file:
        try:
            return subprocess.Popen(
                command.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=how.home.home if how.home else cwd,
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
