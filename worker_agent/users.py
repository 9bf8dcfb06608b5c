"""Engines run as an unprivileged user, never as root.

An engine is a large C++/CUDA program that parses files and serves HTTP; if
it is compromised it should hold none of the agent's power. When the agent
runs as root, each engine is started as ``llmgw-engine``: its uid, gid and
supplementary groups (``video``/``render``, for the GPU device files), a
0700 home under the agent's work directory as working directory, HOME and
XDG_CACHE_HOME there. A node without that user, or whose work directory
the user cannot reach, keeps engines as root and says why in the log.
"""

import grp
import logging
import os
import pwd
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_ENGINE_USER = "llmgw-engine"
GPU_GROUPS = ("video", "render")


@dataclass(frozen=True)
class RunAs:
    """Whom an engine runs as, and where its home is."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: Path

    def env(self) -> dict[str, str]:
        """Variables that keep the engine's caches in its own home."""
        return {
            "HOME": str(self.home),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "USER": self.user,
            "LOGNAME": self.user,
        }


def reachable(path: Path, uid: int, gids: Iterable[int]) -> bool:
    """Whether ``uid`` (with ``gids``) can traverse to and read ``path``."""
    groups = set(gids)
    target = path.resolve()
    for part in [*reversed(target.parents), target]:
        try:
            st = part.stat()
        except OSError:
            return False
        need = stat.S_IXOTH if part != target or stat.S_ISDIR(st.st_mode) else stat.S_IROTH
        if st.st_uid == uid:
            need <<= 6
        elif st.st_gid in groups:
            need <<= 3
        if not st.st_mode & need:
            return False
    return True


def resolve_run_as(
    user: str, work_dir: Path, must_reach: Iterable[Path]
) -> tuple[RunAs | None, str]:
    """Whom engines should run as on this node, and why."""
    if not user:
        return None, "engine user disabled by settings: engines run as the agent's user"
    if os.geteuid() != 0:
        return None, f"agent is not root (uid {os.geteuid()}): engines run as the agent's user"
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None, f"user {user} does not exist (run `llmgw node setup`): engines run as root"
    groups = tuple(sorted(set(os.getgrouplist(user, entry.pw_gid))))
    for path in [work_dir, *must_reach]:
        if not reachable(path, entry.pw_uid, groups):
            return None, f"{user} cannot reach {path}: engines run as root"
    home = work_dir.resolve() / "engine-home"
    return RunAs(user, entry.pw_uid, entry.pw_gid, groups, home), f"engines run as {user}"


def prepare_home(run_as: RunAs) -> None:
    """Create the engine user's home: 0700, owned by the user."""
    run_as.home.mkdir(parents=True, exist_ok=True)
    (run_as.home / ".cache").mkdir(exist_ok=True)
    for path in (run_as.home, run_as.home / ".cache"):
        os.chown(path, run_as.uid, run_as.gid)
        path.chmod(0o700)


def setup_node(user: str = DEFAULT_ENGINE_USER) -> list[str]:
    """Create the engine user in the GPU groups (creating those if missing).

    Returns what was done, for the CLI to print. Needs root.
    """
    done: list[str] = []
    for group in GPU_GROUPS:
        try:
            grp.getgrnam(group)
        except KeyError:
            subprocess.run(["groupadd", "--system", group], check=True)
            done.append(f"created group {group}")
    try:
        pwd.getpwnam(user)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             "--groups", ",".join(GPU_GROUPS), user],
            check=True,
        )  # fmt: skip
        done.append(f"created user {user} in groups {', '.join(GPU_GROUPS)}")
    else:
        subprocess.run(["usermod", "--append", "--groups", ",".join(GPU_GROUPS), user], check=True)
        done.append(f"user {user} exists; ensured groups {', '.join(GPU_GROUPS)}")
    return done
