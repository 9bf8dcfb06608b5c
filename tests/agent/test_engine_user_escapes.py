"""A compromised engine, running as the engine user, tries to become root or to
learn another replica's key (issue 23, A1-A3). Each attack is made for real,
by a process of a real unprivileged user, against the agent's real code."""

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.engine_keys import engine_key
from llmgw.types import ModelSpec, ShardRef, ShardSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import wait_for
from tests.conftest import EngineWatch
from tests.harness import free_port, readable_model, ready_shard
from tests.procs_util import uids
from worker_agent import passthrough, procfs
from worker_agent.engines.spec import SLOTS_SUBDIR
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.privileges import DROP_TO_ENV
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command, user_for
from worker_agent.supervisor import Supervisor
from worker_agent.system_users import SystemUsers
from worker_agent.users import PROXY_USER, RunAs, engine_identity

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")

SECRET = "escape-test-secret"


@pytest.fixture
def open_dir(no_engine_outlives_its_test: EngineWatch) -> Iterator[Path]:
    """A work dir whose parents the engine user can pass (pytest's tmp dirs are 0700):
    outside tmp_path, so watched for engines left running."""
    with no_engine_outlives_its_test.tmp_dir("llmgw-escape-", 0o755) as work:
        yield work


def _identity(user: str, work: Path, must_reach: list[Path] | None = None) -> RunAs:
    identity = engine_identity(
        user, work, work / "agent" / "n1", must_reach or [], admin=SystemUsers()
    )
    assert identity.run_as is not None, identity.why
    return identity.run_as


# An interpreter the engine user can run (the agent's may sit under root's
# 0700 home, as pyenv's does here).
USER_PYTHON = "/usr/bin/python3"


def _as_user(run_as: RunAs, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as the engine user (what a compromised engine can do)."""
    return subprocess.run(
        [USER_PYTHON, "-I", "-c", code, *args],
        user=run_as.uid, group=run_as.gid, extra_groups=list(run_as.groups),
        cwd="/", capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _owner_and_mode(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def _root_target(parent: Path, name: str) -> Path:
    """A root-owned directory an attacker would like to own (a stand-in for /etc)."""
    target = parent / name
    target.mkdir(mode=0o755)
    (target / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    return target


# A1 ---------------------------------------------------------------------------


def test_agent_restart_does_not_follow_a_link_in_the_engine_home(
    user_name: str, open_dir: Path
) -> None:
    run_as = _identity(user_name, open_dir)
    target = _root_target(open_dir, "etc")
    before = _owner_and_mode(target)
    planted = _as_user(
        run_as,
        "import os, shutil, sys; c = sys.argv[1]; shutil.rmtree(c); os.symlink(sys.argv[2], c)",
        str(run_as.home / ".cache"),
        str(target),
    )
    assert planted.returncode == 0, planted.stderr
    assert (run_as.home / ".cache").is_symlink()

    again = _identity(user_name, open_dir)  # what a restarted agent does

    assert _owner_and_mode(target) == before
    assert _owner_and_mode(target / "passwd")[0] == 0
    cache = again.home / ".cache"
    assert not cache.is_symlink() and cache.is_dir()
    assert _owner_and_mode(cache) == (run_as.uid, run_as.gid, 0o700)


def test_relaunch_does_not_follow_a_link_in_the_scratch_dir(user_name: str, open_dir: Path) -> None:
    run_as = _identity(user_name, open_dir)
    sup = Supervisor(open_dir / "agent" / "n1", "n1", run_as)
    ref = ShardRef(replica_id="scratch")
    first = sup.scratch_dir(ref)
    assert _owner_and_mode(first) == (run_as.uid, run_as.gid, 0o700)
    for name in ("tmp", "cache", SLOTS_SUBDIR):
        assert _owner_and_mode(first / name) == (run_as.uid, run_as.gid, 0o700)
    in_tmp, instead = _root_target(open_dir, "etc1"), _root_target(open_dir, "etc2")
    before = [_owner_and_mode(p) for p in (in_tmp, instead)]
    # Its tmp made a link, then the scratch dir itself (the user owns its
    # entry in the sticky /tmp) renamed away and replaced by a link.
    planted = _as_user(
        run_as,
        "import os, sys; root, a, b = sys.argv[1:]\n"
        "os.rmdir(root + '/tmp'); os.symlink(a, root + '/tmp')\n"
        "os.rename(root, root + '.old'); os.symlink(b, root)\n",
        str(first),
        str(in_tmp),
        str(instead),
    )
    assert planted.returncode == 0, planted.stderr
    try:
        second = sup.scratch_dir(ref)  # what a relaunch does
        assert [_owner_and_mode(p) for p in (in_tmp, instead)] == before
        assert second != first and not second.is_symlink()
        assert _owner_and_mode(second / "tmp") == (run_as.uid, run_as.gid, 0o700)
        assert not first.exists() and not first.is_symlink(), "the planted link is removed"
        assert (in_tmp / "passwd").exists() and (instead / "passwd").exists()
    finally:
        shutil.rmtree(f"{first}.old", ignore_errors=True)
        sup.stop(ref, 1)


def _root_only_python(where: Path) -> Path:
    """An interpreter only root can reach, as under root's 0700 home."""
    hidden = where / "hidden"
    hidden.mkdir(mode=0o700)
    python = hidden / "python3"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o700)
    return python


# A2 ---------------------------------------------------------------------------


def test_a_module_planted_in_the_engine_home_never_runs_as_root(
    user_name: str, open_dir: Path
) -> None:
    """The agent's interpreter is unreachable by the engine user, so the
    pass-through starts as root and drops; ``argparse.py`` in the engine home
    (its working directory, later) must not be imported, as root or at all."""
    run_as = _identity(user_name, open_dir)
    seen = open_dir / "seen"
    seen.mkdir(mode=0o777)
    seen.chmod(0o777)
    module = f"import os\nopen({str(seen)!r} + '/ran-as-%d' % os.getuid(), 'w').close()\n"
    planted = _as_user(
        run_as,
        "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
        str(run_as.home / "argparse.py"),
        module,
    )
    assert planted.returncode == 0, planted.stderr
    python = _root_only_python(open_dir)
    sup = Supervisor(open_dir / "agent" / "n1", "n1", run_as)
    ref = ShardRef(replica_id="planted")
    port = free_port()
    argv = passthrough.command(str(python), "127.0.0.1", port, f"http://127.0.0.1:{free_port()}")
    keys = passthrough.keys_input("replica-key", "engine-key")
    running = sup.launch(
        ref,
        [Command(argv, {"PATH": os.environ["PATH"]}, drops_privileges=True, stdin_secret=keys)],
        port,
        f"http://127.0.0.1:{port}",
        ShardRecord(),
    )
    try:
        assert wait_for(lambda: _listening(port) or sup.find_running(ref) is None, 60)
        assert [p.name for p in seen.iterdir()] == [], "the planted module ran"
        assert _listening(port), sup.log_tail(ref)
        assert uids(running.pid) == [run_as.uid] * 4
        assert Path(f"/proc/{running.pid}/cwd").resolve() == run_as.home
    finally:
        sup.stop(ref, 5)
    assert list(seen.iterdir()) == []


def test_the_pass_through_starts_as_root_even_where_the_user_could_run_it() -> None:
    """Started as the engine user, the pass-through would be every engine's to
    ptrace (or read through /proc) until it made itself non-dumpable, with its
    key on the way in: it starts as root, reads the key, and drops itself."""
    run_as = RunAs("someone", 54321, 54321, (54321,), Path("/nonexistent/home"))
    argv = passthrough.command(USER_PYTHON, "127.0.0.1", 1, "http://127.0.0.1:2")
    how = user_for(Command(argv, {}, drops_privileges=True), run_as, allow_root=False)
    assert how.user is None and not how.in_home
    assert how.env[DROP_TO_ENV] == "54321:54321:54321:/nonexistent/home"
    # Any other program the user can run runs as the user, in its home.
    engine = user_for(Command([USER_PYTHON], {}), run_as, allow_root=False)
    assert engine.user == run_as and engine.in_home


def test_a_root_start_without_an_isolated_interpreter_is_refused(
    user_name: str, open_dir: Path
) -> None:
    run_as = _identity(user_name, open_dir)
    python = _root_only_python(open_dir)
    sup = Supervisor(open_dir / "agent" / "n1", "n1", run_as)
    argv = [str(python), "-m", "worker_agent.passthrough"]
    with pytest.raises(Exception, match="isolated Python"):
        sup.launch(
            ShardRef(replica_id="not-isolated"),
            [Command(argv, {}, drops_privileges=True)],
            1,
            "x",
            ShardRecord(),
        )


# A3 ---------------------------------------------------------------------------

# Run as the engine user: everything another engine could read about the
# shard's processes and files. Prints what it could read, and exits 3 if the
# key was in any of it.
_SNOOP = """
import os, sys
key = sys.argv[1].encode()
pids, dirs = sys.argv[2].split(","), sys.argv[3:]
found, read = [], []
def look(what, data):
    read.append(what)
    if key in data:
        found.append(what)
for pid in pids:
    for name in ("environ", "cmdline", "maps"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as fh:
                look(f"{pid}/{name}", fh.read())
        except OSError:
            pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            look(f"{pid}/fd/{fd}", os.read(f, 1 << 20))
        except OSError:
            pass
        finally:
            os.close(f)
for top in dirs:
    for dirpath, _, files in os.walk(top):
        for name in files:
            try:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    look(os.path.join(dirpath, name), fh.read())
            except OSError:
                pass
print("\\n".join(read))
print("FOUND", found)
sys.exit(3 if found else 0)
"""


async def test_another_engine_user_process_cannot_learn_the_key(
    llama: LlamaCppInstall, tiny: TinyModel, user_name: str, open_dir: Path
) -> None:
    model = readable_model(tiny, open_dir)
    run_as = _identity(user_name, open_dir, [llama.server, model])
    sup = Supervisor(open_dir / "agent" / "n1", "n1", run_as)
    replica = "snooped"
    key = engine_key(SECRET, replica)
    ref = ShardRef(replica_id=replica)
    spec = ShardSpec(replica_id=replica, model=ModelSpec(name="tiny-snoop", source=str(model)))
    async with ready_shard(llama, sup, spec, secret=SECRET) as (running, _):
        members = procfs.group_members(running.group)
        assert len(members) == 2, "pass-through and llama-server"
        scratch = Path((sup.shard_dir(ref) / "scratch-path").read_text())
        snoop = _as_user(
            run_as, _SNOOP, key, ",".join(map(str, members)), str(run_as.home), str(scratch)
        )
        assert snoop.returncode == 0, snoop.stdout + snoop.stderr
        # The snoop could read the engine's own files (so it looked), not the key.
        assert f"{running.pid}/environ" in snoop.stdout.splitlines(), snoop.stdout
        # The pass-through is not dumpable: its /proc files are root's.
        front = next(p for p in members if p != running.pid)
        assert Path(f"/proc/{front}/environ").stat().st_uid == 0
        # And the key still opens the replica, through the pass-through only.
        assert _get(running.endpoint, key) == 200
        assert _get(running.endpoint, "wrong") == 401


_KILL = """
import os, signal, sys
try:
    os.kill(int(sys.argv[1]), signal.SIGKILL)
except PermissionError:
    print("denied")
"""


async def test_an_engine_cannot_kill_a_pass_through_and_an_adopted_one_dying_is_noticed(
    llama: LlamaCppInstall, tiny: TinyModel, user_name: str, open_dir: Path
) -> None:
    """The pass-throughs run as their own user (llmgw-proxy): an engine-user
    process (a compromised engine) cannot signal one, so it cannot kill
    another replica's pass-through and take its port. And when a
    pass-through of an adopted shard dies all the same, the new agent sees it
    (the group leader it recorded is gone), as it does for its own children."""
    model = readable_model(tiny, open_dir)
    identity = engine_identity(
        user_name, open_dir, open_dir / "agent" / "n1", [llama.server, model], admin=SystemUsers()
    )
    run_as, proxy = identity.run_as, identity.proxy
    assert run_as is not None and proxy is not None, identity.why
    assert proxy.user == PROXY_USER and proxy.uid != run_as.uid
    assert not {proxy.gid, *proxy.groups} & {run_as.gid, *run_as.groups}
    sup = Supervisor(open_dir / "agent" / "n1", "n1", run_as, proxy=proxy)
    replica = "guarded"
    key = engine_key(SECRET, replica)
    ref = ShardRef(replica_id=replica)
    spec = ShardSpec(replica_id=replica, model=ModelSpec(name="tiny-guard", source=str(model)))
    async with ready_shard(llama, sup, spec, secret=SECRET) as (running, _):
        assert running.group != running.pid
        front = running.group  # the pass-through leads the shard's group
        assert set(uids(front)) == {proxy.uid}
        assert set(uids(running.pid)) == {run_as.uid}
        killed = _as_user(run_as, _KILL, str(front))
        assert killed.stdout.strip() == "denied", killed.stdout + killed.stderr
        assert _get(running.endpoint, key) == 200
        # A new agent adopts the shard; then the pass-through dies anyway.
        again = Supervisor(open_dir / "agent" / "n1", "n1", run_as, proxy=proxy)
        assert again.find_running(ref) is not None
        assert again.dead_sidecar(ref) is None
        os.kill(front, signal.SIGKILL)
        assert wait_for(lambda: again.dead_sidecar(ref) is not None, 10)


def _get(endpoint: str, key: str) -> int:

    return httpx.get(
        f"{endpoint}/v1/models", headers={"Authorization": f"Bearer {key}"}
    ).status_code


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
