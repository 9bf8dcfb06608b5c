"""What every engine installer shares: its error, its progress lines, its lock and its logged steps.

An install (llama.cpp's source build, vLLM's venv) takes minutes, may be started
by several agents or ``llmgw up`` at once on one machine, and fails in ways only
its log explains. So each one serialises on a lock file beside its target,
reports short progress lines, appends every command's output to one log, and
raises with that log's tail.
"""

import fcntl
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from llmgw.errors import LlmgwError

# The file whose presence says an install directory is complete: written last.
MARKER = "COMPLETE"
LOG_TAIL_LINES = 40

Progress = Callable[[str], None]


class EngineInstallError(LlmgwError):
    """The engine could not be installed; the message says why and where the log is."""

    retryable = False


def say(progress: Progress | None, line: str) -> None:
    """Report a progress line, if anyone listens."""
    if progress is not None:
        progress(line)


@contextmanager
def locked(path: Path, progress: Progress | None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made if missing), saying so when it must wait."""
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(progress, f"waiting for another installer ({path.name})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_step(
    step: str, cmd: list[str], log_path: Path, env: Mapping[str, str] | None = None
) -> None:
    """Run ``cmd`` with its output appended to the log; raise with the log's tail on failure."""
    with open(log_path, "a") as log:
        log.write(f"\n=== {step}: {' '.join(cmd)}\n")
        log.flush()
        try:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        except OSError as exc:
            log.write(f"{exc}\n")
            code = -1
    if code != 0:
        lines = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        tail = "\n".join(lines)
        raise EngineInstallError(f"{step} failed (exit {code}); log: {log_path}\n{tail}")
