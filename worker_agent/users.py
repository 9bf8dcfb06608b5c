"""Engines run as an unprivileged user, never silently as root.

An engine is a large C++/CUDA program that parses files and serves HTTP; if
it is compromised it should hold none of the agent's power. When the agent
runs as root, each engine and its pass-through are started as the engine
user (``llmgw-engine``): its uid, gid and supplementary groups
(``video``/``render``, for the GPU device files), a 0700 home under the
agent's work directory as working directory, HOME and XDG_CACHE_HOME there.

The agent creates that user when it is missing. When it cannot (no
``useradd``, a name the system refuses, a work directory the user cannot
reach), it fails closed: engines are refused with an ``EngineUserError``
that becomes the replica's failure reason, unless the operator allowed root
engines (``LLMGW_ALLOW_ROOT_ENGINES=true``).

The work directory holds the store (the engine-key secret) and is private:
0700, or 0710 with the engine user's group where engines run as that user,
so it can pass through to its home, the engine binaries and the weights but
list and read nothing it was not given.
"""

import grp
import importlib
import logging
import os
import pwd
import stat
import subprocess
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmgw.errors import EngineUserError

log = logging.getLogger(__name__)

DEFAULT_ENGINE_USER = "llmgw-engine"
# "uid:gid:g1,g2": set by the supervisor for a pass-through it has to start as
# root (the engine user cannot read the agent's interpreter), which becomes
# that user itself before it listens.
DROP_TO_ENV = "LLMGW_DROP_TO"
GPU_GROUPS = ("video", "render")
ALLOW_ROOT_HINT = "set LLMGW_ALLOW_ROOT_ENGINES=true to run engines as root anyway"


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

    def drop_to(self) -> str:
        """This identity as ``DROP_TO_ENV`` carries it."""
        return f"{self.uid}:{self.gid}:{','.join(str(g) for g in self.groups)}"


@dataclass(frozen=True)
class EngineIdentity:
    """Whom this agent's engines run as, or why it starts none.

    ``run_as`` None with no ``refusal``: engines run as the agent's own user
    (an agent that is not root, or root engines allowed by the operator).
    """

    run_as: RunAs | None = None
    refusal: str = ""
    allow_root: bool = False
    why: str = ""


class UserAdmin(Protocol):
    """Looks up and creates system users (a fake in tests injects failures)."""

    def exists(self, user: str) -> bool:
        """Whether ``user`` is a user of this system."""
        ...

    def create(self, user: str) -> list[str]:
        """Create ``user`` in the GPU groups; what was done. Raises EngineUserError."""
        ...


class SystemUsers:
    """The real thing: ``pwd`` to look up, ``groupadd``/``useradd`` to create."""

    def exists(self, user: str) -> bool:
        """Whether ``user`` is in the passwd database."""
        try:
            pwd.getpwnam(user)
        except KeyError:
            return False
        return True

    def create(self, user: str) -> list[str]:
        """A system user with its own group, no login shell, in the GPU groups."""
        done = self._ensure_gpu_groups()
        _run(
            ["useradd", "--system", "--user-group", "--no-create-home",
             "--shell", "/usr/sbin/nologin", "--groups", ",".join(GPU_GROUPS), user],
        )  # fmt: skip
        done.append(f"created user {user} in groups {', '.join(GPU_GROUPS)}")
        return done

    def ensure_groups(self, user: str) -> list[str]:
        """Add an existing ``user`` to the GPU groups."""
        done = self._ensure_gpu_groups()
        _run(["usermod", "--append", "--groups", ",".join(GPU_GROUPS), user])
        done.append(f"user {user} exists; ensured groups {', '.join(GPU_GROUPS)}")
        return done

    @staticmethod
    def _ensure_gpu_groups() -> list[str]:
        done: list[str] = []
        for group in GPU_GROUPS:
            try:
                grp.getgrnam(group)
            except KeyError:
                _run(["groupadd", "--system", group])
                done.append(f"created group {group}")
        return done


def _run(argv: list[str]) -> None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise EngineUserError(f"{argv[0]} failed: {exc}") from exc
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
        raise EngineUserError(f"{argv[0]} failed: {detail}")


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


def make_private(root: Path, inner: Path, group: int | None = None) -> None:
    """Make ``root`` and the directories down to ``inner`` private to the agent.

    0700; with ``group``, 0710 and that group: its members may pass through
    (to the engine home, binaries and weights) but list nothing. Only
    directories this process owns are changed, and never a shared one such
    as /tmp (sticky bit), which a work dir pointed at by mistake would break.
    """
    root = root.resolve()
    inner = inner.resolve()
    chain = [root, *[p for p in reversed(inner.parents) if root in p.parents], inner]
    mode = 0o700 if group is None else 0o710
    for path in dict.fromkeys(chain):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
        if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
            log.warning("not changing the mode of %s (not ours, or shared)", path)
            continue
        if group is not None and st.st_gid != group:
            os.chown(path, -1, group)
        os.chmod(path, mode)


def engine_identity(
    user: str,
    work_dir: Path,
    agent_dir: Path,
    must_reach: Iterable[Path],
    *,
    admin: UserAdmin,
    allow_root: bool = False,
) -> EngineIdentity:
    """Whom engines run as on this node, creating the engine user when missing.

    Also makes the work dir private (see ``make_private``). Never raises for
    a missing user: a refusal is returned, and every launch reports it.
    """
    if os.geteuid() != 0:
        make_private(work_dir, agent_dir)
        why = f"agent is not root (uid {os.geteuid()}): engines run as the agent's user"
        return EngineIdentity(why=why)
    try:
        run_as = _engine_user(user, work_dir, agent_dir, list(must_reach), admin)
    except EngineUserError as err:
        make_private(work_dir, agent_dir)
        if allow_root:
            why = f"{err}: engines run as root (LLMGW_ALLOW_ROOT_ENGINES=true)"
            return EngineIdentity(allow_root=True, why=why)
        refusal = f"engines are not started as root: {err}; {ALLOW_ROOT_HINT}"
        return EngineIdentity(refusal=refusal, why=refusal)
    return EngineIdentity(run_as=run_as, allow_root=allow_root, why=f"engines run as {user}")


def _engine_user(
    user: str, work_dir: Path, agent_dir: Path, must_reach: list[Path], admin: UserAdmin
) -> RunAs:
    if not user:
        raise EngineUserError("no engine user is configured (LLMGW_ENGINE_USER is empty)")
    if not admin.exists(user):
        for line in admin.create(user):
            log.info("engine user: %s", line)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise EngineUserError(f"user {user} does not exist after creating it") from None
    if entry.pw_uid == 0:
        raise EngineUserError(f"engine user {user} has uid 0")
    groups = tuple(sorted(set(os.getgrouplist(user, entry.pw_gid))))
    make_private(work_dir, agent_dir, entry.pw_gid)
    for path in [agent_dir, *must_reach]:
        if not reachable(path, entry.pw_uid, groups):
            raise EngineUserError(f"{user} cannot reach {path}")
    home = agent_dir.resolve() / "engine-home"
    run_as = RunAs(user, entry.pw_uid, entry.pw_gid, groups, home)
    prepare_home(run_as)
    return run_as


def prepare_home(run_as: RunAs) -> None:
    """Create the engine user's home: 0700, owned by the user."""
    run_as.home.mkdir(parents=True, exist_ok=True)
    (run_as.home / ".cache").mkdir(exist_ok=True)
    for path in (run_as.home, run_as.home / ".cache"):
        os.chown(path, run_as.uid, run_as.gid)
        path.chmod(0o700)


def setup_node(user: str = DEFAULT_ENGINE_USER, admin: SystemUsers | None = None) -> list[str]:
    """Create the engine user in the GPU groups (creating those if missing).

    Returns what was done, for the CLI to print. Needs root.
    """
    users = admin or SystemUsers()
    return users.ensure_groups(user) if users.exists(user) else users.create(user)


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


# Modules the standard library imports lazily while serving (getaddrinfo
# encodes host names with idna): loaded before the drop, because the engine
# user may not be able to read the interpreter's library afterwards.
_PRELOAD = ("encodings.idna", "encodings.ascii", "encodings.latin_1", "stringprep")


def drop_privileges(drop_to: str) -> None:
    """Become ``uid:gid:groups`` for good (groups first: they need root); fail loudly."""
    for module in _PRELOAD:
        importlib.import_module(module)
    uid, gid, groups = drop_to.split(":")
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setgid(int(gid))
    os.setuid(int(uid))
    if 0 in (os.getuid(), os.geteuid()) or 0 in os.getresuid():
        raise SystemExit(f"still root after dropping to {drop_to}")


def drop_privileges_on_startup(app: Asgi, environ: MutableMapping[str, str]) -> Asgi:
    """``app``, becoming the user in ``environ[DROP_TO_ENV]`` at lifespan startup.

    Late enough that the server's modules are all loaded (from an interpreter
    the engine user may not read), early enough that the socket is not open
    yet: uvicorn binds after lifespan startup. A no-op without the variable.
    """
    drop_to = environ.pop(DROP_TO_ENV, "")
    if not drop_to:
        return app

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def receive_and_drop() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                drop_privileges(drop_to)
            return message

        await app(scope, receive_and_drop, send)

    return wrapped
