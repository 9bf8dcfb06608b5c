"""The store: catalog, client API keys (hashed) and the engine-key secret.

SQLite by default, PostgreSQL by URL. Temporal holds what runs where; the
store holds configuration and accounting, never the same fact twice.
The class is synchronous (SQLModel sessions); async callers go through a
thread, which keeps one code path for both databases.
"""

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import event, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlmodel import Field, Session, SQLModel, create_engine, select

from llmgw.errors import StoreError
from llmgw.keys import hash_api_key, new_api_key, new_secret
from llmgw.types import EngineKind, ModelSpec

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


class Store:
    """Access to the store; build one per process and pass it down."""

    def __init__(self, url: str) -> None:
        self._engine: Engine = create_engine(url, pool_pre_ping=True)
        self._sqlite_file: Path | None = None
        if url.startswith("sqlite"):
            event.listen(self._engine, "connect", _sqlite_pragmas)
            if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
                self._sqlite_file = Path(url.removeprefix("sqlite:///"))

    def migrate(self) -> None:
        """Create missing tables; safe when several processes start at once."""
        if self._sqlite_file is not None:
            # Processes starting together (agent, router, CLI) would each see
            # a table missing and race to create it: one at a time.
            self._sqlite_file.parent.mkdir(parents=True, exist_ok=True)
            with open(f"{self._sqlite_file}.migrate-lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._create_tables()
            return
        self._create_tables()

    def _create_tables(self) -> None:
        for attempt in range(3):
            try:
                SQLModel.metadata.create_all(self._engine)
                self._add_missing_columns()
                return
            except OperationalError as exc:
                # Two processes both saw a table missing and both created it:
                # the loser's next pass finds everything in place.
                if "already exists" not in str(exc) or attempt == 2:
                    raise StoreError(f"cannot migrate the store: {exc}") from exc

    def _add_missing_columns(self) -> None:
        """Additive migrations: columns added to a table since it was created."""
        inspector = inspect(self._engine)
        with self._engine.begin() as conn:
            for table in SQLModel.metadata.sorted_tables:
                have = {c["name"] for c in inspector.get_columns(table.name)}
                for column in table.columns:
                    if column.name in have:
                        continue
                    kind = column.type.compile(dialect=self._engine.dialect)
                    default = getattr(column.default, "arg", None)
                    literal = f" DEFAULT {default!r}" if isinstance(default, (int, str)) else ""
                    conn.exec_driver_sql(
                        f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}{literal}'
                    )

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
            session.commit()

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
