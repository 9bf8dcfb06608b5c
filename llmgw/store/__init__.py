"""The store: catalog, client API keys (hashed) and the engine-key secret.

SQLite by default, PostgreSQL by URL. Temporal holds what runs where; the
store holds configuration and accounting, never the same fact twice.
It holds the engine-key secret, from which every engine's key derives: a
SQLite store's file, its -wal/-shm and lock files are 0600 (a directory the
store creates, 0700), and errors never carry a statement's bound parameters.
The class is synchronous (SQLModel sessions); async callers go through a
thread, which keeps one code path for both databases.
"""

import contextlib
import fcntl
import json
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from sqlalchemy import event, inspect, text
from sqlalchemy import literal as sa_literal
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, SQLAlchemyError
from sqlmodel import Field, Session, SQLModel, create_engine, select

from llmgw.api_keys import hash_api_key, new_api_key
from llmgw.engine_keys import new_secret
from llmgw.errors import StoreError
from llmgw.store import (
    gateway_tables,  # noqa: F401  (registers the gateway's tables)
    openai_tables,  # noqa: F401  (registers the Files, Batches and Responses tables)
)
from llmgw.types import EngineKind, ModelSpec

LAYER = "store"  # this package's layer in the dependency rule: tests/test_layers.py
ENGINE_KEY_SECRET = "engine-key-secret"


class Secret(SQLModel, table=True):
    """A named secret (today: the engine-key secret)."""

    name: str = Field(primary_key=True)
    value: str


class ApiKey(SQLModel, table=True):
    """A client API key; only its hash is kept."""

    id: int | None = Field(default=None, primary_key=True)
    name: str
    key_hash: str = Field(unique=True, index=True)
    prefix: str
    created_at: datetime
    revoked: bool = False
    # Policy (router.api.apikeys): JSON list of models ("" = every model), expiry,
    # admin (admin API only), quotas (0 = unlimited; router.billing.quotas).
    models_json: str = ""
    expires_at: datetime | None = None
    admin: bool = False
    rpm: int = 0
    tpm: int = 0
    token_budget: int = 0
    budget_period: str = "day"
    # The admission queue (router/admission/fair_queue.py): share of a saturated
    # model's tokens relative to other keys, and priority class.
    weight: float = 1.0
    priority: str = "normal"


class ModelRecord(SQLModel, table=True):
    """A model in the catalog."""

    name: str = Field(primary_key=True)
    engine: str
    source: str
    gpus: int = 0
    context_length: int = 512
    engine_args_json: str = "[]"
    # The whole ModelSpec (profile included); the columns above stay for
    # people reading the table by hand.
    spec_json: str = ""
    replicas: int = 1

    def spec(self) -> ModelSpec:
        """The catalog entry as a start needs it."""
        if self.spec_json:
            return ModelSpec.model_validate_json(self.spec_json)
        return ModelSpec(
            name=self.name,
            engine=EngineKind(self.engine),
            source=self.source,
            gpus=self.gpus,
            context_length=self.context_length,
            engine_args=json.loads(self.engine_args_json),
        )


def _sqlite_pragmas(dbapi_conn: object, _record: object) -> None:
    # WAL lets the router read while the agent or CLI writes; the busy
    # timeout turns "database is locked" into a short wait.
    cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


# Any fixed 64-bit number; every llmgw process uses this one to take turns
# migrating a PostgreSQL store.
PG_MIGRATE_LOCK = 0x6C6C6D67_77000001
# ...and this one to write the catalog one at a time (``Store.catalog_lock``).
PG_CATALOG_LOCK = 0x6C6C6D67_77000002


def sqlalchemy_url(url: str) -> URL:
    """The SQLAlchemy URL of a store URL: ``postgresql://`` means psycopg 3.

    SQLAlchemy would pick psycopg2 for a bare ``postgresql://``; users should
    not have to know driver names.
    """
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def display_url(url: str) -> str:
    """A store URL fit for messages and logs: the password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable store URL>"


def _private_file(path: Path, create: bool = True) -> None:
    """Make ``path`` 0600 (creating it empty when asked); a file we do not own is left.

    By path, never by opening it: SQLite's locks are POSIX record locks, which
    a process loses on *every* descriptor of the file the moment it closes
    any one of them. Opening and closing the database or its -shm file here,
    while another connection of this process holds its locks, let a second
    process take the -shm for its own and truncate it under this one's
    mapping: SIGBUS in a commit (seen in the router and the agent). Only a
    file that does not exist yet is opened, to create it, and no one can
    hold a lock on a file that did not exist.
    """
    if create:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            return
        except FileExistsError:
            pass
        except OSError:
            return  # its directory is missing or closed: SQLite reports that itself
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o600:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)


def _lock_file(path: str) -> TextIO:
    """A lock file beside the database, opened for writing, 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    if os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w")


def _create_tables(conn: Connection) -> None:
    """Every table in SQLModel.metadata, then columns added since a table was made."""
    SQLModel.metadata.create_all(conn)
    inspector = inspect(conn)
    quote = conn.dialect.identifier_preparer.quote
    for table in SQLModel.metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            kind = column.type.compile(dialect=conn.dialect)
            default = getattr(column.default, "arg", None)
            literal = ""
            if isinstance(default, (bool, int, float, str)):
                # Rendered by the dialect: True is 1 in SQLite, true in PostgreSQL.
                rendered = sa_literal(default, column.type).compile(
                    dialect=conn.dialect, compile_kwargs={"literal_binds": True}
                )
                literal = f" DEFAULT {rendered}"
            conn.exec_driver_sql(
                f"ALTER TABLE {quote(table.name)} ADD COLUMN {quote(column.name)} {kind}{literal}"
            )


class Store:
    """Access to the store; build one per process and pass it down."""

    def __init__(self, url: str) -> None:
        try:
            parsed = sqlalchemy_url(url)
        except ArgumentError as exc:
            raise StoreError(f"bad store URL {display_url(url)!r}: {exc}") from None
        self.backend = parsed.get_backend_name()
        self._sqlite_file: Path | None = None
        self._memory_lock = threading.Lock()  # catalog_lock of an in-memory store
        if self.backend == "postgresql":
            # Timestamps are stored without a zone; UTC on every connection
            # keeps them meaning the same whatever the server's TimeZone.
            self._engine: Engine = create_engine(
                parsed,
                pool_pre_ping=True,
                hide_parameters=True,
                connect_args={"options": "-c timezone=UTC"},
            )
        else:
            # hide_parameters: an error's text would otherwise quote the values
            # of the failing statement (a secret, a key hash) into logs.
            self._engine = create_engine(parsed, pool_pre_ping=True, hide_parameters=True)
        if self.backend == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                self._sqlite_file = Path(parsed.database)
            event.listen(self._engine, "connect", self._sqlite_connect)

    def _sqlite_connect(self, dbapi_conn: object, record: object) -> None:
        if self._sqlite_file is not None:
            # Before SQLite opens the file: it creates the -wal and -shm files
            # with the database file's permissions.
            _private_file(self._sqlite_file)
        _sqlite_pragmas(dbapi_conn, record)
        if self._sqlite_file is not None:
            for suffix in ("-wal", "-shm"):
                _private_file(Path(f"{self._sqlite_file}{suffix}"), create=False)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for whole-store operations such as a copy)."""
        return self._engine

    def migrate(self) -> None:
        """Create missing tables and columns; safe when several processes start at once."""
        try:
            if self.backend == "postgresql":
                # DDL is transactional here: the lock is held to commit, so
                # processes starting together migrate one after another and
                # each later one finds everything in place.
                with self._engine.begin() as conn:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATE_LOCK})
                    _create_tables(conn)
            elif self._sqlite_file is not None:
                # Processes starting together (agent, router, CLI) would each
                # see a table missing and race to create it: one at a time.
                self._sqlite_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                with _lock_file(f"{self._sqlite_file}.migrate-lock") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    self._create_sqlite_tables()
            else:
                self._create_sqlite_tables()
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot migrate the store: {exc}") from exc

    def _create_sqlite_tables(self) -> None:
        for attempt in range(3):
            try:
                with self._engine.begin() as conn:
                    _create_tables(conn)
                return
            except OperationalError as exc:
                # Two processes both saw a table missing and both created it
                # (a store not under the file lock): the loser's next pass
                # finds everything in place.
                if "already exists" not in str(exc) or attempt == 2:
                    raise

    @contextmanager
    def catalog_lock(self) -> Iterator[None]:
        """One catalog writer at a time, across processes.

        Whether an entry fits the catalog depends on the other entries
        (adapter names share the models' namespace): the check and the write
        happen under this lock, or two writers could each pass their check
        and together break the catalog. PostgreSQL: an advisory lock; SQLite
        (one host): a lock file beside the database.
        """
        if self.backend == "postgresql":
            with self._engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": PG_CATALOG_LOCK})
                conn.commit()
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": PG_CATALOG_LOCK})
                    conn.commit()
        elif self._sqlite_file is not None:
            with _lock_file(f"{self._sqlite_file}.catalog-lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                yield
        else:
            with self._memory_lock:
                yield

    def close(self) -> None:
        """Release pooled connections."""
        self._engine.dispose()

    @contextmanager
    def _session(self) -> Iterator[Session]:
        try:
            with Session(self._engine) as session:
                yield session
        except OperationalError as exc:
            raise StoreError(f"store unavailable: {exc}") from exc

    def session(self) -> AbstractContextManager[Session]:
        """A session for modules that keep their own tables (keys, quotas, usage)."""
        return self._session()

    def engine_key_secret(self) -> str:
        """The engine-key secret, made on first use.

        Two processes may race to make it; the primary key lets one win and
        the other reads the winner's value, so all agree on one secret.
        """
        with self._session() as session:
            row = session.get(Secret, ENGINE_KEY_SECRET)
            if row is not None:
                return row.value
            session.add(Secret(name=ENGINE_KEY_SECRET, value=new_secret()))
            try:
                session.commit()
            except IntegrityError:
                session.rollback()
            row = session.get(Secret, ENGINE_KEY_SECRET)
            assert row is not None
            return row.value

    def create_api_key(self, name: str) -> str:
        """Create a client key and return it in clear: the only time it is shown."""
        key = new_api_key()
        with self._session() as session:
            session.add(
                ApiKey(
                    name=name,
                    key_hash=hash_api_key(key),
                    prefix=key[:14],
                    created_at=datetime.now(UTC),
                )
            )
            session.commit()
        return key

    def find_api_key(self, key: str) -> ApiKey | None:
        """The live key record matching a presented key, or None.

        The lookup is by hash, so no stored value is compared byte by byte
        against attacker input.
        """
        with self._session() as session:
            row = session.exec(select(ApiKey).where(ApiKey.key_hash == hash_api_key(key))).first()
            if row is None or row.revoked:
                return None
            return row

    def put_model(self, spec: ModelSpec, replicas: int | None = None) -> None:
        """Add or replace a catalog entry (and its desired replicas, when given)."""
        for attempt in range(2):
            with self._session() as session:
                row = session.get(ModelRecord, spec.name) or ModelRecord(
                    name=spec.name, engine=spec.engine.value, source=spec.source
                )
                row.spec_json = spec.model_dump_json()
                if replicas is not None:
                    row.replicas = replicas
                row.engine = spec.engine.value
                row.source = spec.source
                row.gpus = spec.gpus
                row.context_length = spec.context_length
                row.engine_args_json = json.dumps(spec.engine_args)
                session.add(row)
                try:
                    session.commit()
                    return
                except IntegrityError:
                    # Another writer added the same name between our read and
                    # insert: the second pass updates its row instead.
                    if attempt == 1:
                        raise

    def get_model(self, name: str) -> ModelSpec | None:
        """A catalog entry by name."""
        with self._session() as session:
            row = session.get(ModelRecord, name)
            return row.spec() if row else None

    def catalog(self) -> dict[str, ModelSpec]:
        """Every catalog entry, by name."""
        with self._session() as session:
            return {r.name: r.spec() for r in session.exec(select(ModelRecord)).all()}

    def delete_model(self, name: str) -> bool:
        """Remove a catalog entry; False when there was none."""
        with self._session() as session:
            row = session.get(ModelRecord, name)
            if row is None:
                return False
            session.delete(row)
            session.commit()
            return True

    def model_names(self) -> list[str]:
        """Every model in the catalog."""
        with self._session() as session:
            return sorted(r.name for r in session.exec(select(ModelRecord)).all())
