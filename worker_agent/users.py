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
"""

import contextlib
import ctypes
import errno
import grp
import hashlib
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

from llmgw.errors import EngineLaunchError, EngineUserError

log = logging.getLogger(__name__)

DEFAULT_ENGINE_USER = "llmgw-engine"
# Whom the pass-throughs run as: another uid than the engines', so no engine
# can signal or ptrace a replica's pass-through (kill it and bind its port).
# No GPU groups, no home (it works in "/").
PROXY_USER = "llmgw-proxy"
# "uid:gid:g1,g2:home": set by the supervisor for a pass-through it has to
# start as root (the engine user cannot read the agent's interpreter), which
# becomes that user itself, and only then enters its home, before it listens.
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
        """This identity as ``DROP_TO_ENV`` carries it: ``uid:gid:g1,g2:home``."""
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


class UserAdmin(Protocol):
    """Looks up and creates system users (a fake in tests injects failures)."""

    def exists(self, user: str) -> bool:
        """Whether ``user`` is a user of this system."""
        ...

    def create(self, user: str) -> list[str]:
        """Create ``user`` in the GPU groups; what was done. Raises EngineUserError."""
        ...

    def create_plain(self, user: str) -> list[str]:
        """Create ``user`` in no group but its own; what was done. Raises EngineUserError."""
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

    def create_plain(self, user: str) -> list[str]:
        """A system user with its own group only, no login shell, no home."""
        _run(
            ["useradd", "--system", "--user-group", "--no-create-home",
             "--home-dir", "/", "--shell", "/usr/sbin/nologin", user],
        )  # fmt: skip
        return [f"created user {user}"]

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


def system_base(system_dir: Path, work_dir: Path) -> Path:
    """This work dir's directory in ``system_dir``: one per work dir (a digest of
    its resolved path), so two clones on one host never share a home or cache."""
    digest = hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:16]
    return system_dir / digest


def system_place(system_dir: Path, work_dir: Path, node: str, group: int) -> Path:
    """``<system_dir>/<digest of the work dir>/agent/<node>``, made by root for the
    engine user's ``group`` to pass: for a work dir that user cannot reach.

    ``system_dir`` (default /var/lib/llmgw) is root's and 0711 when the agent
    makes it: anyone may pass, nobody may list it or write to it. One that
    exists is the operator's (``LLMGW_SYSTEM_DIR=/srv``): it is used as it is
    if root's alone (not a link, not writable by group or others), never
    changed. Below it all is 0710, root's with the engine group, as the work
    dir itself would be: the group passes to what it was given (its home,
    the weights cache, the engine cache) and lists nothing. A ``work-dir``
    file says which work dir a digest belongs to. Raises EngineUserError
    where a link could be planted: ``system_dir`` or a directory above it
    not root's alone (checked before anything is made).
    """
    _check_parents(system_dir)
    system_dir.parent.mkdir(parents=True, exist_ok=True)
    _owned_dir(system_dir, 0o711, None, keep_existing=True)
    base = system_base(system_dir, work_dir)
    place = base / "agent" / node
    for path in (base, base / "agent", place):
        _owned_dir(path, 0o710, group)
    # Two agents of one work dir may start together: the first note stands.
    with contextlib.suppress(FileExistsError):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(base / "work-dir", flags, 0o600), "w") as fh:
            fh.write(f"{work_dir.resolve()}\n")
    return place


def _check_parents(path: Path) -> None:
    """Refuse ``path`` when a directory above it that exists is another user's,
    or writable by others without the sticky bit: one could swap ``path``."""
    for parent in path.parents:
        try:
            st = parent.stat()
        except FileNotFoundError:
            continue  # made below, by the agent
        if st.st_uid not in (0, os.geteuid()) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        ):
            raise EngineUserError(f"{parent}, above {path}, is writable by others")


def _owned_dir(path: Path, mode: int, group: int | None, *, keep_existing: bool = False) -> None:
    """Make ``path`` a real directory (not a link) of root's with ``mode`` and ``group``.

    ``keep_existing``: one that exists already is not changed, only checked
    (root's, not writable by group or others); ``mode`` is for a new one.
    """
    created = True
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        created = False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise EngineUserError(f"{path} belongs to uid {st.st_uid}, not the agent's")
        if keep_existing and not created:
            if st.st_mode & 0o022:
                raise EngineUserError(
                    f"{path} is writable by {'group' if st.st_mode & 0o020 else 'others'}"
                    f" (mode {stat.S_IMODE(st.st_mode):o}): not changed, not used"
                )
            return
        os.fchown(fd, -1, group if group is not None else st.st_gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


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


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


# Modules the standard library imports lazily while serving (getaddrinfo
# encodes host names with idna): loaded before the drop, because the engine
# user may not be able to read the interpreter's library afterwards.
_PRELOAD = ("encodings.idna", "encodings.ascii", "encodings.latin_1", "stringprep")


# prctl(2) option: whether this process's /proc files (environ, fds, memory)
# may be read, and the process ptraced, by other processes of its uid.
PR_SET_DUMPABLE = 4


def not_dumpable() -> None:
    """Make this process non-dumpable (``PR_SET_DUMPABLE`` 0) until it execs.

    Every engine runs as the same user: without this, any of them could read
    this process's ``/proc/<pid>/environ``, open its descriptors through
    ``/proc/<pid>/fd`` and, where ptrace is allowed, its memory, and so learn
    the key it holds. Non-dumpable, those files belong to root. A change of
    uid resets the flag from ``fs.suid_dumpable``: call it again after one.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise EngineLaunchError(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(err)}")


def drop_privileges(drop_to: str) -> None:
    """Become ``uid:gid:groups:home`` for good (groups first: they need root), then
    enter the home; fail loudly.

    The process was started as root in a root-owned directory with an
    isolated interpreter (``-I``: no script directory, working directory or
    user site on ``sys.path``); it enters the engine user's home only now, as
    that user, so nothing the engine user put there runs as root.
    """
    for module in _PRELOAD:
        importlib.import_module(module)
    uid, gid, groups, home = [*drop_to.split(":", 3), ""][:4]
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setgid(int(gid))
    os.setuid(int(uid))
    if 0 in (os.getuid(), os.geteuid()) or 0 in os.getresuid():
        raise EngineUserError(f"still root after dropping to {drop_to}")
    not_dumpable()
    if home:
        os.chdir(home)


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
