"""Engines run as an unprivileged user, never silently as root.

An engine is a large C++/CUDA program that parses files and serves HTTP; if
it is compromised it should hold none of the agent's power. When the agent
runs as root, each engine and its pass-through are started as the engine
user (``llmgw-engine``): its uid, gid and supplementary groups
(``video``/``render``, for the GPU device files), a 0700 home under the
agent's work directory as working directory, HOME and XDG_CACHE_HOME there.

The pass-throughs (which hold the replica keys) run as another user,
``llmgw-proxy`` (no GPU groups, no home): an engine, compromised, cannot
signal or ptrace a pass-through, so it can neither kill another replica's
and take its port nor read its memory.

The agent creates these users when they are missing. When it cannot (no
``useradd``, a name the system refuses), it fails closed: engines are refused
with an ``EngineUserError`` that becomes the replica's failure reason, unless
the operator allowed root engines (``LLMGW_ALLOW_ROOT_ENGINES=true``).

A work directory the user cannot reach (a clone under root's 0700 home) is
not a refusal: what the user must reach (its home, the weights cache, the
engine cache) goes to ``<LLMGW_SYSTEM_DIR>/<digest of the work dir>/``
(default /var/lib/llmgw), which the agent makes and owns (``system_place``),
and the agent logs where. Only when that cannot be made either is it one.

The engine user owns its home and what is in it, so the agent never follows
a link there: it works on directory descriptors opened ``O_NOFOLLOW``
(``own_dir_at``).

The work directory holds the store (the engine-key secret) and is private:
0700, or 0710 with the engine user's group where engines run as that user,
so it can pass through to its home, the engine binaries and the weights but
list and read nothing it was not given.

Looking up and creating the users is worker_agent/system_users.py; the
system directory, worker_agent/system_dir.py; the drop a pass-through
started as root makes to its user, worker_agent/privileges.py.
"""

import contextlib
import errno
import logging
import os
import pwd
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import EngineUserError
from worker_agent.system_dir import system_place
from worker_agent.system_users import SystemUsers, UserAdmin

log = logging.getLogger(__name__)

DEFAULT_ENGINE_USER = "llmgw-engine"
# Whom the pass-throughs run as: another uid than the engines', so no engine
# can signal or ptrace a replica's pass-through (kill it and bind its port).
# No GPU groups, no home (it works in "/").
PROXY_USER = "llmgw-proxy"
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
        """This identity as ``DROP_TO_ENV`` carries it (worker_agent/privileges.py):
        ``uid:gid:g1,g2:home``."""
        return f"{self.uid}:{self.gid}:{','.join(str(g) for g in self.groups)}:{self.home}"


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
    # Where what the engine user must reach lives (its home, the weights
    # cache): the agent dir, or a system directory (``system_place``).
    engine_dir: Path | None = None
    # Whom the pass-throughs become (PROXY_USER), with run_as only.
    proxy: RunAs | None = None


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
    system_dir: Path | None = None,
    proxy_name: str = PROXY_USER,
) -> EngineIdentity:
    """Whom engines run as on this node, creating the engine user when missing.

    Also makes the work dir private (see ``make_private``). Never raises for
    a missing user: a refusal is returned, and every launch reports it.

    What the engine user must reach (its home, the weights cache) lives in
    ``EngineIdentity.engine_dir``: the agent dir when the user can reach it,
    else, with ``system_dir``, a directory the agent makes there for this
    work dir (``system_place``): a clone under root's 0700 home works.

    The pass-throughs run as ``proxy_name`` (created like the engine user,
    in no GPU group); where it cannot be made, engines are refused as when
    the engine user cannot be (or run as root, if allowed).
    """
    if os.geteuid() != 0:
        make_private(work_dir, agent_dir)
        why = f"agent is not root (uid {os.geteuid()}): engines run as the agent's user"
        return EngineIdentity(why=why, engine_dir=agent_dir.resolve())
    try:
        run_as = _engine_user(user, work_dir, agent_dir, list(must_reach), admin, system_dir)
        proxy = proxy_user(proxy_name, admin, run_as)
    except EngineUserError as err:
        make_private(work_dir, agent_dir)
        return _without_user(str(err), agent_dir, allow_root)
    why = f"engines run as {user}"
    engine_dir = run_as.home.parent
    if engine_dir != agent_dir.resolve():
        why += (
            f"; {user} cannot reach the work dir {work_dir.resolve()}, so its home and the"
            f" weights cache are in {engine_dir}"
        )
    why += f"; pass-throughs as {proxy.user}"
    return EngineIdentity(
        run_as=run_as, allow_root=allow_root, why=why, engine_dir=engine_dir, proxy=proxy
    )


def proxy_user(user: str, admin: UserAdmin, engine: RunAs) -> RunAs:
    """The pass-throughs' user, created (in no group but its own) when missing.

    Raises EngineUserError where it cannot be made, or shares a uid or a
    group with the engine user (which could then signal it or read its files).
    """
    if not user:
        raise EngineUserError("no pass-through user is configured")
    entry, groups = _made(user, admin.exists, admin.create_plain, "pass-through user")
    if entry.pw_uid in (0, engine.uid):
        raise EngineUserError(f"pass-through user {user} has uid {entry.pw_uid}")
    if entry.pw_gid in (0, engine.gid) or set(groups) & {0, *engine.groups}:
        raise EngineUserError(f"pass-through user {user} shares a group with root or {engine.user}")
    return RunAs(user, entry.pw_uid, entry.pw_gid, groups, Path("/"))


def _made(
    user: str, exists: Callable[[str], bool], create: Callable[[str], list[str]], what: str
) -> tuple[pwd.struct_passwd, tuple[int, ...]]:
    """``user``'s passwd entry and groups, made by ``create`` (its output logged
    as ``what``'s) when it does not exist yet."""
    if not exists(user):
        for line in create(user):
            log.info("%s: %s", what, line)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise EngineUserError(f"user {user} does not exist after creating it") from None
    return entry, tuple(sorted(set(os.getgrouplist(user, entry.pw_gid))))


def _without_user(err: str, agent_dir: Path, allow_root: bool) -> EngineIdentity:
    if allow_root:
        why = f"{err}: engines run as root (LLMGW_ALLOW_ROOT_ENGINES=true)"
        return EngineIdentity(allow_root=True, why=why, engine_dir=agent_dir.resolve())
    refusal = f"engines are not started as root: {err}; {ALLOW_ROOT_HINT}"
    return EngineIdentity(refusal=refusal, why=refusal, engine_dir=agent_dir.resolve())


def require_reach(identity: EngineIdentity, paths: Iterable[Path]) -> EngineIdentity:
    """``identity``, or its refusal (or root engines, if allowed) when its user
    cannot reach one of ``paths`` (an engine binary found after the user was)."""
    run_as = identity.run_as
    if run_as is None:
        return identity
    for path in paths:
        if not reachable(path, run_as.uid, run_as.groups):
            err = f"{run_as.user} cannot reach {path}"
            return _without_user(
                err, identity.engine_dir or run_as.home.parent, identity.allow_root
            )
    return identity


def _engine_user(
    user: str,
    work_dir: Path,
    agent_dir: Path,
    must_reach: list[Path],
    admin: UserAdmin,
    system_dir: Path | None,
) -> RunAs:
    if not user:
        raise EngineUserError("no engine user is configured (LLMGW_ENGINE_USER is empty)")
    entry, groups = _made(user, admin.exists, admin.create, "engine user")
    if entry.pw_uid == 0:
        raise EngineUserError(f"engine user {user} has uid 0")
    make_private(work_dir, agent_dir, entry.pw_gid)
    engine_dir = agent_dir.resolve()
    if not reachable(agent_dir, entry.pw_uid, groups):
        if system_dir is None:
            raise EngineUserError(f"{user} cannot reach {agent_dir}")
        try:
            engine_dir = system_place(system_dir, work_dir, agent_dir.name, entry.pw_gid)
        except (EngineUserError, OSError) as exc:
            raise EngineUserError(
                f"{user} cannot reach {agent_dir}, and no directory it can reach could be made"
                f" in {system_dir} (LLMGW_SYSTEM_DIR): {exc}"
            ) from exc
        if not reachable(engine_dir, entry.pw_uid, groups):
            raise EngineUserError(f"{user} cannot reach {agent_dir}, nor {engine_dir}")
    for path in must_reach:
        if not reachable(path, entry.pw_uid, groups):
            raise EngineUserError(f"{user} cannot reach {path}")
    run_as = RunAs(user, entry.pw_uid, entry.pw_gid, groups, engine_dir / "engine-home")
    prepare_home(run_as)
    return run_as


def prepare_home(run_as: RunAs) -> None:
    """Create the engine user's home and its ``.cache``: 0700, owned by the user.

    The engine user owns the home, so anything in it may be a link it planted
    (``.cache -> /etc``): every step is opened relative to its parent's
    descriptor with ``O_NOFOLLOW|O_DIRECTORY`` and changed through that
    descriptor (``fchown``/``fchmod``), and whatever is not a directory there
    is removed (the link, never its target). The home's parent is the agent's
    own directory, which the engine user cannot write.
    """
    parent = os.open(run_as.home.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        home = own_dir_at(parent, run_as.home.name, run_as.uid, run_as.gid)
        try:
            os.close(own_dir_at(home, ".cache", run_as.uid, run_as.gid))
        finally:
            os.close(home)
    finally:
        os.close(parent)


def own_dir_at(dirfd: int, name: str, uid: int, gid: int, mode: int = 0o700) -> int:
    """The directory ``name`` in ``dirfd``, made or found without following a link,
    given to ``uid:gid`` with ``mode``; its open descriptor (the caller closes it).

    A link or a file in its place is unlinked first: only the name goes, the
    target is not touched. Raises EngineUserError if it keeps changing under us.
    """
    for _ in range(5):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dirfd)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
        except FileNotFoundError:
            continue  # removed between mkdir and open: again
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            log.warning("removing %r (not a directory: %s) from an engine directory", name, exc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dirfd)
            continue
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        return fd
    raise EngineUserError(f"{name}: keeps changing while the agent prepares it")


def setup_node(user: str = DEFAULT_ENGINE_USER, admin: SystemUsers | None = None) -> list[str]:
    """Create the engine user in the GPU groups (creating those if missing).

    Returns what was done, for the CLI to print. Needs root.
    """
    users = admin or SystemUsers()
    done = users.ensure_groups(user) if users.exists(user) else users.create(user)
    if not users.exists(PROXY_USER):
        done += users.create_plain(PROXY_USER)
    return done
