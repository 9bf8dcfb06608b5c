"""The store on both databases: SQLite (file) and PostgreSQL (a real server)."""

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table
from sqlmodel import Session, select

from llmgw.errors import StoreError
from llmgw.store import ApiKey, Store, display_url, sqlalchemy_url
from llmgw.types import EngineKind, ModelSpec, ReplicaMemo, ReplicaPhase
from router.app import create_app
from tests.gateway_util import serving


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store(store_url)
    s.migrate()
    yield s
    s.close()


def test_postgresql_urls_use_psycopg_and_hide_passwords() -> None:
    assert sqlalchemy_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert sqlalchemy_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert sqlalchemy_url("sqlite:///x.db").drivername == "sqlite"
    shown = display_url("postgresql://u:hunter2@h:5433/db")
    assert "hunter2" not in shown and "h:5433/db" in shown


def test_catalog(store: Store) -> None:
    a = ModelSpec(name="a", source="/a.gguf", engine_args=["--ctx-size", "64"])
    b = ModelSpec(name="b", source="/b.gguf", engine=EngineKind.LLAMA_CPP, gpus=0)
    store.put_model(a)
    store.put_model(b, replicas=3)
    assert store.model_names() == ["a", "b"]
    assert store.get_model("a") == a
    assert store.get_model("missing") is None
    changed = a.model_copy(update={"context_length": 1024})
    store.put_model(changed)
    assert store.get_model("a") == changed


def test_api_keys(store: Store) -> None:
    key = store.create_api_key("alice")
    other = store.create_api_key("bob")
    found = store.find_api_key(key)
    assert found is not None and found.name == "alice" and found.id is not None
    assert found.key_hash != key  # only the hash is stored
    assert found.created_at.year >= 2025
    assert store.find_api_key(key + "x") is None
    with Session(store.engine) as session:
        row = session.exec(select(ApiKey).where(ApiKey.name == "alice")).one()
        row.revoked = True
        session.add(row)
        session.commit()
    assert store.find_api_key(key) is None
    assert store.find_api_key(other) is not None


def test_secret_is_made_once_and_kept(store_url: str, store: Store) -> None:
    secret = store.engine_key_secret()
    assert len(secret) == 64
    again = Store(store_url)
    try:
        assert again.engine_key_secret() == secret
    finally:
        again.close()


def test_additive_migration_adds_columns_with_defaults(store_url: str) -> None:
    # The tables as an older llmgw made them: no spec_json/replicas, no revoked.
    old = MetaData()
    models = Table(
        "modelrecord", old,
        Column("name", String, primary_key=True), Column("engine", String),
        Column("source", String), Column("gpus", Integer), Column("context_length", Integer),
        Column("engine_args_json", String),
    )  # fmt: skip
    Table(
        "apikey", old,
        Column("id", Integer, primary_key=True), Column("name", String),
        Column("key_hash", String), Column("prefix", String), Column("created_at", DateTime),
    )  # fmt: skip
    s = Store(store_url)
    try:
        with s.engine.begin() as conn:
            old.create_all(conn)
            conn.execute(
                models.insert().values(
                    name="old", engine="llama.cpp", source="/old.gguf", gpus=0,
                    context_length=256, engine_args_json='["-t", "1"]',
                )
            )  # fmt: skip
        s.migrate()
        s.migrate()  # a second run finds everything in place
        spec = s.get_model("old")
        assert spec is not None and spec.context_length == 256 and spec.engine_args == ["-t", "1"]
        with s.engine.connect() as conn:
            row = conn.exec_driver_sql("SELECT replicas, spec_json FROM modelrecord").one()
        assert tuple(row) == (1, "")  # the declared defaults filled the old rows
        key = s.create_api_key("after")  # the new revoked column takes its default
        assert s.find_api_key(key) is not None
    finally:
        s.close()


def test_concurrent_migrations_of_a_fresh_store(store_url: str) -> None:
    stores = [Store(store_url) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda s: s.migrate(), stores))
        with ThreadPoolExecutor(4) as pool:
            secrets = set(pool.map(lambda s: s.engine_key_secret(), stores))
        assert len(secrets) == 1  # every process agrees on the one secret
    finally:
        for s in stores:
            s.close()


def test_concurrent_writers(store_url: str) -> None:
    stores = [Store(store_url) for _ in range(4)]
    stores[0].migrate()

    def write(i: int) -> list[str]:
        s = stores[i % len(stores)]
        s.put_model(ModelSpec(name=f"m{i}", source=f"/{i}.gguf"), replicas=i)
        s.put_model(ModelSpec(name="shared", source=f"/{i}.gguf"))
        return [s.create_api_key(f"k{i}-{j}") for j in range(5)]

    try:
        with ThreadPoolExecutor(8) as pool:
            keys = [k for batch in pool.map(write, range(16)) for k in batch]
        reader = stores[0]
        assert len(set(keys)) == 80
        names = {f"m{i}" for i in range(16)} | {"shared"}
        assert set(reader.model_names()) == names
        for key in keys:
            assert reader.find_api_key(key) is not None
        with Session(reader.engine) as session:
            ids = session.exec(select(ApiKey.id)).all()
        assert len(set(ids)) == 80
    finally:
        for s in stores:
            s.close()


def test_unreachable_store_is_a_store_error() -> None:
    dead = Store("postgresql://postgres@127.0.0.1:1/nothing")
    try:
        with pytest.raises(StoreError):
            dead.migrate()
        with pytest.raises(StoreError):
            dead.get_model("x")
    finally:
        dead.close()


class _OneReplica:
    async def replicas(self) -> list[ReplicaMemo]:
        return [
            ReplicaMemo(
                replica_id="r1", model="a", phase=ReplicaPhase.READY, endpoint="http://127.0.0.1:9"
            )
        ]


async def test_router_authenticates_against_the_store(store: Store) -> None:
    store.put_model(ModelSpec(name="a", source="/a.gguf"))
    key = store.create_api_key("client")
    app = create_app(store, _OneReplica(), refresh_interval_s=0.05)
    async with serving(app) as http:
        ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
        assert [m["id"] for m in ok.json()["data"]] == ["a"]
        bad = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}x"})
        assert bad.status_code == 401
