"""Copying a whole store into an empty one: ``llmgw store migrate --to URL``.

Generic over ``SQLModel.metadata``: every table llmgw defines, present and
future, is copied row for row, the engine-key secret included (a new secret
would lock the router out of every running engine). A table in the source
that this llmgw does not define stops the copy rather than being left behind.
"""

import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Connection, Integer, func, inspect, select, text
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlmodel import SQLModel

from llmgw.errors import ConfigError, StoreError
from llmgw.store import PG_MIGRATE_LOCK, Store, display_url, sqlalchemy_url

BATCH_ROWS = 1000

Say = Callable[[str], object]


def migrate_store(source_url: str, target_url: str, say: Say) -> int:
    """Copy the store at ``source_url`` into the empty store at ``target_url``.

    Returns the number of rows copied; raises ConfigError when the target is
    not empty (or is the source) and StoreError when a database fails.
    """
    if _same_database(source_url, target_url):
        raise ConfigError("the target is the current store; give a new, empty database")
    source, target = Store(source_url), Store(target_url)
    try:
        source.migrate()
        target.migrate()
        say(f"copying {display_url(source_url)} -> {display_url(target_url)}")
        started = time.monotonic()
        counts = copy_store(source, target, lambda table, rows: say(f"  {table}: {rows} rows"))
        total = sum(counts.values())
        say(f"copied {total} rows in {len(counts)} tables in {time.monotonic() - started:.1f} s")
        return total
    finally:
        source.close()
        target.close()


def copy_store(
    source: Store, target: Store, progress: Callable[[str, int], object]
) -> dict[str, int]:
    """Copy every table of ``source`` into ``target`` in one target transaction.

    Both stores must be migrated. Nothing is written unless every table of
    the target is empty; a failure part way leaves the target as it was.
    """
    tables = SQLModel.metadata.sorted_tables  # parents before children
    counts: dict[str, int] = {}
    try:
        with source.engine.connect() as src, target.engine.begin() as dst:
            if source.backend == "postgresql":
                # One snapshot of the source for every table.
                src.execution_options(isolation_level="REPEATABLE READ")
            if target.backend == "postgresql":
                # Processes migrating the target wait until the copy is in.
                dst.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATE_LOCK})
            _refuse_unknown_tables(src, {t.name for t in tables})
            _refuse_non_empty(dst)
            for table in tables:
                copied = 0
                result = src.execute(select(table).execution_options(yield_per=BATCH_ROWS))
                for batch in result.partitions():
                    dst.execute(table.insert(), [dict(row._mapping) for row in batch])
                    copied += len(batch)
                counts[table.name] = copied
                progress(table.name, copied)
            if target.backend == "postgresql":
                _advance_sequences(dst)
    except SQLAlchemyError as exc:
        raise StoreError(f"the copy failed, nothing was written to the target: {exc}") from exc
    return counts


def _same_database(a: str, b: str) -> bool:
    def identity(url: str) -> tuple[object, ...]:
        u = sqlalchemy_url(url)
        if u.get_backend_name() == "sqlite":
            return ("sqlite", str(Path(u.database or "").resolve()))
        return (u.get_backend_name(), u.host or "localhost", u.port or 5432, u.database)

    try:
        return identity(a) == identity(b)
    except ArgumentError:
        return False


def _refuse_unknown_tables(src: Connection, known: set[str]) -> None:
    unknown = sorted(set(inspect(src).get_table_names()) - known)
    if unknown:
        raise ConfigError(
            f"the current store has tables this llmgw does not define: {', '.join(unknown)};"
            " run `llmgw store migrate` from the llmgw version that wrote them"
        )


def _refuse_non_empty(dst: Connection) -> None:
    for table in SQLModel.metadata.sorted_tables:
        rows = dst.execute(select(func.count()).select_from(table)).scalar_one()
        if rows:
            raise ConfigError(
                f"the target store is not empty (table {table.name} has {rows} rows);"
                " migrate into a new, empty database"
            )


def _advance_sequences(dst: Connection) -> None:
    """Move PostgreSQL id sequences past the copied ids.

    Rows came with their ids, so the sequences never advanced: the next
    insert would reuse id 1 and fail.
    """
    quote = dst.dialect.identifier_preparer.quote
    for table in SQLModel.metadata.sorted_tables:
        column = table.autoincrement_column
        if column is None or not isinstance(column.type, Integer):
            continue
        dst.execute(
            text(
                f"SELECT setval(pg_get_serial_sequence(:table, :column),"
                f" COALESCE(MAX({quote(column.name)}), 0) + 1, false)"
                f" FROM {quote(table.name)}"
            ),
            {"table": quote(table.name), "column": column.name},
        )
