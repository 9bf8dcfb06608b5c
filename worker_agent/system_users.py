"""The system's users: looked up with ``pwd``, created with ``groupadd``/``useradd``.

Split from worker_agent/users.py, which decides whom engines run as and takes
a :class:`UserAdmin` (this :class:`SystemUsers`, or a test's fake that
injects failures) to find or create the engine user (in the GPU groups, for
the device files) and the pass-throughs' user (in no group but its own).
"""

import grp
import pwd
import subprocess
from typing import Protocol

from llmgw.errors import EngineUserError

GPU_GROUPS = ("video", "render")


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
