"""Engines run as an unprivileged user, never silently as root.

Each test that creates a user gives it a name of its own and deletes it
afterwards, so the tests can be repeated on one machine (they run as root,
as CI does).
"""

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from llmgw.errors import EngineUserError
from llmgw.types import LaunchShardInput, ModelSpec, ShardRef, ShardSpec
from llmgw_cli.dev.tinymodel import TinyModel
from tests.conftest import delete_user
from tests.harness import node_activities, readable_model, ready_shard
from tests.procs_util import uids
from worker_agent import procfs
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.launch import engine_env
from worker_agent.shard_record import ShardRecord
from worker_agent.spawn import Command
from worker_agent.supervisor import Supervisor
from worker_agent.system_dir import system_place
from worker_agent.system_users import SystemUsers
from worker_agent.users import (
    DEFAULT_ENGINE_USER,
    EngineIdentity,
    engine_identity,
    make_private,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")


@pytest.fixture
def throwaway_user(user_name: str) -> str:
    """A user name nobody has; the user is deleted afterwards if a test made it."""
    assert not SystemUsers().exists(user_name)
    return user_name


@pytest.fixture
def open_work_dir() -> Iterator[Path]:
    """A work dir whose parents the engine user can pass (pytest's tmp dirs are 0700)."""
    work = Path(tempfile.mkdtemp(prefix="llmgw-user-", dir="/tmp"))
    work.chmod(0o755)
    yield work
    shutil.rmtree(work, ignore_errors=True)


class CannotCreateUsers:
    """A system where user creation fails (no useradd, a read-only /etc...)."""

    def exists(self, user: str) -> bool:
        return False

    def create(self, user: str) -> list[str]:
        raise EngineUserError(f"useradd failed: cannot create {user} (injected)")

    def create_plain(self, user: str) -> list[str]:
        return self.create(user)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_node_setup_creates_the_user_in_gpu_groups() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "node", "setup"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    entry = pwd.getpwnam(DEFAULT_ENGINE_USER)
    groups = subprocess.run(
        ["id", "-nG", DEFAULT_ENGINE_USER], capture_output=True, text=True, check=True
    )
    assert {"video", "render"} <= set(groups.stdout.split())
    assert entry.pw_uid != 0


def test_agent_creates_a_missing_engine_user(throwaway_user: str, open_work_dir: Path) -> None:
    agent_dir = open_work_dir / "agent" / "n1"
    identity = engine_identity(throwaway_user, open_work_dir, agent_dir, [], admin=SystemUsers())
    assert identity.refusal == "" and identity.run_as is not None, identity.why
    entry = pwd.getpwnam(throwaway_user)
    assert entry.pw_uid != 0 and identity.run_as.uid == entry.pw_uid
    groups = subprocess.run(
        ["id", "-nG", throwaway_user], capture_output=True, text=True, check=True
    )
    assert {"video", "render"} <= set(groups.stdout.split())
    # The work dir is private, but the engine user's group may pass to its home.
    for path in (open_work_dir, open_work_dir / "agent", agent_dir):
        assert _mode(path) == 0o710 and path.stat().st_gid == entry.pw_gid, path
    home = identity.run_as.home.stat()
    assert home.st_uid == entry.pw_uid and (home.st_mode & 0o777) == 0o700


def test_refuses_engines_when_the_user_cannot_be_created(open_work_dir: Path) -> None:
    agent_dir = open_work_dir / "agent" / "n1"
    identity = engine_identity(
        "llmgw-never-made", open_work_dir, agent_dir, [], admin=CannotCreateUsers()
    )
    assert identity.run_as is None
    assert "cannot create llmgw-never-made" in identity.refusal
    assert "LLMGW_ALLOW_ROOT_ENGINES=true" in identity.refusal
    assert _mode(open_work_dir) == 0o700  # nobody else needs to pass


class CannotCreateProxy(SystemUsers):
    """The engine user can be made, the pass-through user cannot."""

    def create_plain(self, user: str) -> list[str]:
        raise EngineUserError(f"useradd failed: cannot create {user} (injected)")


def test_the_pass_through_user_is_made_without_gpu_groups(
    throwaway_user: str, open_work_dir: Path
) -> None:
    proxy_name = f"llmgw-p{secrets.token_hex(4)}"
    try:
        identity = engine_identity(
            throwaway_user, open_work_dir, open_work_dir / "agent" / "n1", [],
            admin=SystemUsers(), proxy_name=proxy_name,
        )  # fmt: skip
        assert identity.run_as is not None and identity.proxy is not None, identity.why
        entry = pwd.getpwnam(proxy_name)
        assert identity.proxy.uid == entry.pw_uid not in (0, identity.run_as.uid)
        groups = subprocess.run(
            ["id", "-nG", proxy_name], capture_output=True, text=True, check=True
        )
        assert groups.stdout.split() == [proxy_name]
        assert f"pass-throughs as {proxy_name}" in identity.why
    finally:
        delete_user(proxy_name)


@pytest.mark.parametrize("allow_root", [False, True])
def test_no_pass_through_user_fails_closed_like_no_engine_user(
    throwaway_user: str, open_work_dir: Path, allow_root: bool
) -> None:
    identity = engine_identity(
        throwaway_user, open_work_dir, open_work_dir / "agent" / "n1", [],
        admin=CannotCreateProxy(), allow_root=allow_root, proxy_name="llmgw-never-made",
    )  # fmt: skip
    assert identity.run_as is None and identity.proxy is None
    assert "cannot create llmgw-never-made" in identity.why
    if allow_root:
        assert identity.refusal == "" and identity.allow_root
    else:
        assert "LLMGW_ALLOW_ROOT_ENGINES=true" in identity.refusal


def test_allow_root_engines_runs_them_as_root_instead(open_work_dir: Path) -> None:
    identity = engine_identity(
        "llmgw-never-made",
        open_work_dir,
        open_work_dir / "agent" / "n1",
        [],
        admin=CannotCreateUsers(),
        allow_root=True,
    )
    assert identity.run_as is None and identity.refusal == "" and identity.allow_root
    assert "LLMGW_ALLOW_ROOT_ENGINES=true" in identity.why


def test_empty_engine_user_is_refused_not_root(open_work_dir: Path) -> None:
    identity = engine_identity("", open_work_dir, open_work_dir / "a", [], admin=SystemUsers())
    assert identity.run_as is None and "no engine user" in identity.refusal


def test_unreachable_work_dir_is_refused_not_root(tmp_path: Path) -> None:
    """pytest's tmp dirs sit under a 0700 dir: the engine user cannot reach them."""
    subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "node", "setup"], check=True, capture_output=True
    )
    identity = engine_identity(
        DEFAULT_ENGINE_USER, tmp_path, tmp_path / "agent" / "n1", [], admin=SystemUsers()
    )
    assert identity.run_as is None
    assert "cannot reach" in identity.refusal


def _identity_with_system_dir(user: str, work: Path, system_dir: Path) -> EngineIdentity:
    """The engine identity of an agent (node n1) of ``work`` given LLMGW_SYSTEM_DIR."""
    return engine_identity(
        user, work, work / "agent" / "n1", [], admin=SystemUsers(), system_dir=system_dir
    )


def test_unreachable_work_dir_moves_to_the_system_dir(
    tmp_path: Path, throwaway_user: str, open_work_dir: Path
) -> None:
    """A work dir under a 0700 dir: the home goes to the system dir, made for it."""
    system_dir = open_work_dir / "system"
    identity = _identity_with_system_dir(throwaway_user, tmp_path, system_dir)
    assert identity.run_as is not None and not identity.refusal, identity.why
    [base] = list(system_dir.iterdir())
    assert identity.engine_dir == base / "agent" / "n1"
    assert identity.run_as.home == base / "agent" / "n1" / "engine-home"
    assert str(identity.engine_dir) in identity.why
    assert (base / "work-dir").read_text() == f"{tmp_path.resolve()}\n"
    assert _mode(system_dir) == 0o711 and _mode(base) == 0o710
    assert base.stat().st_gid == identity.run_as.gid


def test_an_existing_system_dir_is_used_as_it_is_never_changed(
    tmp_path: Path, throwaway_user: str, open_work_dir: Path
) -> None:
    """LLMGW_SYSTEM_DIR=/srv: the operator's directory keeps its mode (it was
    made 0711, which locks everyone else out of listing it)."""
    system_dir = open_work_dir / "srv"
    system_dir.mkdir()
    system_dir.chmod(0o755)
    identity = _identity_with_system_dir(throwaway_user, tmp_path, system_dir)
    assert identity.run_as is not None and not identity.refusal, identity.why
    assert _mode(system_dir) == 0o755
    [base] = list(system_dir.iterdir())
    assert _mode(base) == 0o710


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_an_existing_system_dir_others_may_write_is_refused_unchanged(
    tmp_path: Path, throwaway_user: str, open_work_dir: Path, mode: int
) -> None:
    system_dir = open_work_dir / "srv"
    system_dir.mkdir()
    system_dir.chmod(mode)
    identity = _identity_with_system_dir(throwaway_user, tmp_path, system_dir)
    assert identity.run_as is None and "writable by" in identity.refusal
    assert _mode(system_dir) == mode and list(system_dir.iterdir()) == []


def test_a_system_dir_below_an_untrusted_parent_is_not_made(open_work_dir: Path) -> None:
    """The parents are checked first: nothing is made under a directory others
    may write (they could swap it for a link)."""
    shared = open_work_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(EngineUserError, match="writable by others"):
        system_place(shared / "system", open_work_dir / "work", "n1", os.getgid())
    assert not (shared / "system").exists()


def test_two_agents_making_one_place_both_get_it(open_work_dir: Path) -> None:
    """The second finds the work-dir note made (O_EXCL): not an error."""
    system_dir, work = open_work_dir / "system", open_work_dir / "work"
    first = system_place(system_dir, work, "n1", os.getgid())
    note = first.parents[1] / "work-dir"
    assert note.read_text() == f"{work.resolve()}\n"
    assert system_place(system_dir, work, "n2", os.getgid()).parent == first.parent
    assert note.read_text() == f"{work.resolve()}\n"


@pytest.mark.parametrize("bad", ["link", "writable"])
def test_a_system_dir_that_cannot_be_trusted_is_refused_not_root(
    tmp_path: Path, throwaway_user: str, open_work_dir: Path, bad: str
) -> None:
    """Fail closed only when no place can be made: a link, or a parent others may write."""
    if bad == "link":
        (open_work_dir / "elsewhere").mkdir()
        system_dir = open_work_dir / "system"
        system_dir.symlink_to(open_work_dir / "elsewhere")
    else:
        shared = open_work_dir / "shared"
        shared.mkdir()
        shared.chmod(0o777)  # no sticky bit: anyone could swap our directory
        system_dir = shared / "system"
    identity = _identity_with_system_dir(throwaway_user, tmp_path, system_dir)
    assert identity.run_as is None
    assert f"no directory it can reach could be made in {system_dir}" in identity.refusal
    assert "LLMGW_SYSTEM_DIR" in identity.refusal and "LLMGW_ALLOW_ROOT_ENGINES" in identity.refusal


async def test_refused_launch_fails_with_engine_user_error(
    llama: LlamaCppInstall, tiny: TinyModel, open_work_dir: Path
) -> None:
    """The refusal is the launch's error, typed and not retried: the replica's reason."""
    agent_dir = open_work_dir / "agent" / "n1"
    identity = engine_identity(
        "llmgw-never-made", open_work_dir, agent_dir, [], admin=CannotCreateUsers()
    )
    sup = Supervisor(agent_dir, "n1", identity.run_as, refusal=identity.refusal)
    acts = node_activities(llama, sup)
    spec = ShardSpec(replica_id="refused", model=ModelSpec(name="t", source=str(tiny.model_path)))
    try:
        with pytest.raises(ApplicationError) as err:
            await ActivityEnvironment().run(acts.launch_shard, LaunchShardInput(spec=spec))
    finally:
        await acts.aclose()
    assert err.value.type == "EngineUserError" and err.value.non_retryable
    assert "cannot create llmgw-never-made" in str(err.value)
    assert sup.running() == []


def test_unreachable_program_is_refused_not_run_as_root(
    throwaway_user: str, open_work_dir: Path
) -> None:
    agent_dir = open_work_dir / "agent" / "n1"
    identity = engine_identity(throwaway_user, open_work_dir, agent_dir, [], admin=SystemUsers())
    assert identity.run_as is not None, identity.why
    hidden = open_work_dir / "hidden"
    hidden.mkdir(mode=0o700)
    program = hidden / "engine"
    program.write_text("#!/bin/sh\nsleep 60\n")
    program.chmod(0o755)
    sup = Supervisor(agent_dir, "n1", identity.run_as)
    ref = ShardRef(replica_id="hidden")
    with pytest.raises(EngineUserError, match="cannot reach"):
        sup.launch(ref, [Command([str(program)], {})], 1, "x", ShardRecord())
    # Allowed: it runs, as the agent's user, and says so.
    allowed = Supervisor(agent_dir, "n1", identity.run_as, allow_root=True)
    running = allowed.launch(ref, [Command([str(program)], {})], 1, "x", ShardRecord())
    try:
        assert uids(running.pid)[0] == 0
    finally:
        allowed.stop(ref, 5)


def test_make_private_leaves_shared_directories_alone(tmp_path: Path) -> None:
    """A work dir pointed at /tmp by mistake must not turn /tmp private."""
    before = _mode(Path("/tmp"))
    make_private(Path("/tmp"), Path("/tmp"))
    assert _mode(Path("/tmp")) == before


def test_engine_env_is_an_allow_list() -> None:
    agent = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "CUDA_HOME": "/usr/local/cuda",
        "NCCL_DEBUG": "INFO",
        "PGPASSWORD": "pg-secret",
        "AWS_SECRET_ACCESS_KEY": "aws-secret",
        "AWS_ACCESS_KEY_ID": "aws-id",
        "HF_TOKEN": "hf-secret",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer x",
        "LLMGW_STORE_URL": "postgresql://u:pw@db/llmgw",
        "VLLM_API_KEY": "old-key",
        "SSH_AUTH_SOCK": "/tmp/ssh-x/agent.1",
        "http_proxy": "http://user:pw@proxy:3128",
    }
    assert engine_env(agent) == {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "CUDA_HOME": "/usr/local/cuda",
        "NCCL_DEBUG": "INFO",
    }


async def test_engine_and_pass_through_run_as_engine_user(
    llama: LlamaCppInstall, tiny: TinyModel, open_work_dir: Path, throwaway_user: str
) -> None:
    model = readable_model(tiny, open_work_dir)
    agent_dir = open_work_dir / "agent" / "n1"
    identity = engine_identity(
        throwaway_user, open_work_dir, agent_dir, [llama.server, model], admin=SystemUsers()
    )
    run_as = identity.run_as
    assert run_as is not None, identity.why
    sup = Supervisor(agent_dir, "user-node", run_as)
    ref = ShardRef(replica_id="as-user")
    spec = ShardSpec(replica_id="as-user", model=ModelSpec(name="tiny-user", source=str(model)))
    async with ready_shard(llama, sup, spec) as (running, handle):
        members = procfs.group_members(running.group)
        assert len(members) == 2, "pass-through and llama-server"
        for pid in members:
            assert uids(pid) == [run_as.uid] * 4, pid
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"HOME={run_as.home}".encode() in environ
            assert Path(f"/proc/{pid}/cwd").resolve() == run_as.home
        log = running.log_path
        assert _mode(log) == 0o600 and log.stat().st_uid == 0
        assert _mode(sup.shard_dir(ref)) == 0o700
        assert _mode(sup.shard_dir(ref) / "spec.json") == 0o600
        assert handle.pid == running.pid
