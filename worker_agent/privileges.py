"""A process started as root becoming the engine's user for good: the privilege
drop of a pass-through, and the non-dumpable flag that keeps its key from the
engines.

Split from worker_agent/users.py (whom engines run as): this is what the
pass-through process runs on itself, at start, so it imports as little as it
can. The supervisor sets ``DROP_TO_ENV`` for a pass-through it has to start
as root (the engine user cannot read the agent's interpreter).
"""

import ctypes
import importlib
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from llmgw.errors import EngineLaunchError, EngineUserError

# "uid:gid:g1,g2:home": set by the supervisor for a pass-through it has to
# start as root (the engine user cannot read the agent's interpreter), which
# becomes that user itself, and only then enters its home, before it listens.
DROP_TO_ENV = "LLMGW_DROP_TO"

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
