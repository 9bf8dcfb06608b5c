"""``llmgw store migrate``: SQLite to a real PostgreSQL, everything copied."""

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from sqlalchemy import text
from temporalio.client import Client

from llmgw import replicas
from llmgw.errors import ConfigError
from llmgw.store import Store
from llmgw.types import EngineKind, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from llmgw_cli.procs import wait_for
from llmgw_cli.store_copy import copy_store, migrate_store
from tests.harness import System, free_port, port_open, wait_routable
from tests.pg import PgCluster

SPECS = [
    ModelSpec(name="tiny", source="/m/tiny.gguf", engine_args=["--ctx-size", "128"]),
    ModelSpec(name="big", source="/m/big.gguf", gpus=2, context_length=8192),
]


def _llmgw(store_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LLMGW_STORE_URL=store_url)
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _filled_sqlite(path: Path) -> tuple[str, str, list[str]]:
    """A SQLite store with a catalog, keys (one revoked) and the secret."""
    url = f"sqlite:///{path}"
    store = Store(url)
    try:
        store.migrate()
        store.put_model(SPECS[0])
        store.put_model(SPECS[1], replicas=3)
        keys = [store.create_api_key(f"k{i}") for i in range(3)]
        revoked = store.create_api_key("gone")
        with store.engine.begin() as conn:
            conn.execute(text("UPDATE apikey SET revoked = 1 WHERE name = 'gone'"))
        keys.append(revoked)
        return url, store.engine_key_secret(), keys
    finally:
        store.close()


def test_migrate_sqlite_to_postgresql(tmp_path: Path, pg_cluster: PgCluster) -> None:
    source_url, secret, keys = _filled_sqlite(tmp_path / "old.db")
    target_url = pg_cluster.create_database()

    done = _llmgw(source_url, "store", "migrate", "--to", target_url)
    assert done.returncode == 0, done.stderr
    for line in ("secret: 1 rows", "apikey: 4 rows", "modelrecord: 2 rows", "copied 7 rows"):
        assert line in done.stdout

    pg = Store(target_url)
    try:
        pg.migrate()  # what every process does when it starts on the new URL
        assert pg.engine_key_secret() == secret  # running engines still accept the router
        for key in keys[:3]:
            found = pg.find_api_key(key)
            assert found is not None and found.name.startswith("k")
        assert pg.find_api_key(keys[3]) is None  # still revoked
        assert pg.model_names() == ["big", "tiny"]
        assert pg.get_model("tiny") == SPECS[0] and pg.get_model("big") == SPECS[1]
        with pg.engine.connect() as conn:
            assert conn.execute(text("SELECT replicas FROM modelrecord WHERE name='big'")).scalar()
        # New rows after the copy get fresh ids (the id sequence moved past the copied ones).
        fresh = pg.create_api_key("after")
        found = pg.find_api_key(fresh)
        assert found is not None and found.id == 5
    finally:
        pg.close()

    again = _llmgw(source_url, "store", "migrate", "--to", target_url)
    assert again.returncode == 1
    assert "not empty" in again.stderr and "migrate into a new, empty database" in again.stderr


def test_copy_back_to_sqlite_and_refusals(tmp_path: Path, pg_cluster: PgCluster) -> None:
    source_url, secret, keys = _filled_sqlite(tmp_path / "old.db")
    pg_url = pg_cluster.create_database()
    lines: list[str] = []
    assert migrate_store(source_url, pg_url, lines.append) == 7
    assert any("apikey: 4 rows" in line for line in lines)

    # And back from PostgreSQL into a new SQLite file.
    back_url = f"sqlite:///{tmp_path / 'back.db'}"
    assert migrate_store(pg_url, back_url, lines.append) == 7
    back = Store(back_url)
    try:
        assert back.engine_key_secret() == secret
        assert back.find_api_key(keys[0]) is not None
    finally:
        back.close()

    with pytest.raises(ConfigError, match="not empty"):
        migrate_store(source_url, back_url, lines.append)
    with pytest.raises(ConfigError, match="is the current store"):
        migrate_store(source_url, source_url, lines.append)


def test_a_table_this_llmgw_does_not_define_stops_the_copy(
    tmp_path: Path, pg_cluster: PgCluster
) -> None:
    source_url, _, _ = _filled_sqlite(tmp_path / "old.db")
    source = Store(source_url)
    with source.engine.begin() as conn:
        conn.execute(text("CREATE TABLE fromthefuture (id INTEGER PRIMARY KEY)"))
    target = Store(pg_cluster.create_database())
    try:
        target.migrate()
        with pytest.raises(ConfigError, match="fromthefuture"):
            copy_store(source, target, lambda _table, _rows: None)
        with target.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM secret")).scalar() == 0
    finally:
        source.close()
        target.close()


def test_every_table_reaches_the_migrate_command() -> None:
    """A table defined in a module ``llmgw store migrate`` never imports would
    be neither created nor copied; every module of every package is checked."""
    walk = (
        "import importlib, pkgutil, sqlmodel\n"
        "for pkg in ('llmgw', 'router', 'workflows', 'activities', 'worker_agent', 'llmgw_cli'):\n"
        "    importlib.import_module(pkg)\n"
        "    for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + '.'):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        "print(' '.join(sorted(sqlmodel.SQLModel.metadata.tables)))\n"
    )
    cli = (
        "import llmgw_cli.app, sqlmodel; print(' '.join(sorted(sqlmodel.SQLModel.metadata.tables)))"
    )
    tables = []
    for code in (walk, cli):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        tables.append(set(done.stdout.split()))
    everywhere, seen_by_cli = tables
    assert {"secret", "apikey", "modelrecord"} <= seen_by_cli
    missing = everywhere - seen_by_cli
    assert not missing, f"import the modules of tables {missing} from llmgw/store/__init__.py"


async def test_a_router_on_the_migrated_store_reaches_running_engines(
    temporal_address: str, client: Client, tiny: TinyModel, tmp_path: Path, pg_cluster: PgCluster
) -> None:
    """A live system on SQLite; its store migrated to PostgreSQL; a router on
    the new store still authenticates the old client key and is accepted by
    the engine started before the move (the secret came along)."""
    system = System(temporal_address, tmp_path / "llmgw", free_port())
    system.work_dir.mkdir()
    spec = ModelSpec(name="tiny-moved", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    try:
        key = system.catalog(spec)
        system.spawn("control")
        system.spawn("agent", {"LLMGW_NODE_ID": "moved-node"})
        old_port = free_port()
        old_router = system.start_router(old_port)
        await replicas.wait_node_registered(client, "moved-node", 60)
        replica_id = await replicas.start_replica(client, spec)
        await replicas.wait_ready(client, replica_id, 120)
        await wait_routable(f"http://127.0.0.1:{old_port}/v1", key, spec.name)
        old_router.stop()

        pg_url = pg_cluster.create_database()
        done = _llmgw(system.store_url, "store", "migrate", "--to", pg_url)
        assert done.returncode == 0, done.stderr

        port = free_port()
        router = system.spawn("router", {"LLMGW_PORT": str(port), "LLMGW_STORE_URL": pg_url})
        assert wait_for(lambda: port_open(port) or not router.alive(), 60), router.log_tail()
        base = f"http://127.0.0.1:{port}/v1"
        await wait_routable(base, key, spec.name)
        oai = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            answer = await oai.chat.completions.create(
                model=spec.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        finally:
            await oai.close()
        assert answer.choices[0].message.content is not None
        await replicas.stop_replica(client, replica_id, "test over", 30)
    finally:
        system.stop()
