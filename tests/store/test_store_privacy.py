"""The store holds the engine-key secret: its files are private, its errors quote no values."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from llmgw.api_keys import hash_api_key
from llmgw.errors import StoreError
from llmgw.store import Store

SECRET_KEY = "sk-llmgw-do-not-print-0123456789"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def loose_umask() -> object:
    """The usual umask: without explicit modes, files would come out 0644."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_store_files_are_0600_in_a_0700_directory(tmp_path: Path, loose_umask: object) -> None:
    work = tmp_path / "work"
    db = work / "llmgw.db"
    store = Store(f"sqlite:///{db}")
    try:
        store.migrate()
        store.engine_key_secret()
        with store.catalog_lock():
            store.create_api_key("k")  # a write: the WAL and shared-memory files exist now
            files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
            files += [Path(f"{db}.migrate-lock"), Path(f"{db}.catalog-lock")]
            for path in files:
                assert path.exists(), path
                assert _mode(path) == 0o600, (path, oct(_mode(path)))
        assert _mode(work) == 0o700
    finally:
        store.close()


def test_an_existing_world_readable_store_is_made_private(
    tmp_path: Path, loose_umask: object
) -> None:
    db = tmp_path / "llmgw.db"
    first = Store(f"sqlite:///{db}")
    first.migrate()
    first.close()
    db.chmod(0o644)  # as an older llmgw left it
    store = Store(f"sqlite:///{db}")
    try:
        assert store.engine_key_secret()
        assert _mode(db) == 0o600
    finally:
        store.close()


def test_errors_do_not_quote_bound_parameters(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'llmgw.db'}"
    store = Store(url)  # not migrated: every statement fails
    try:
        with pytest.raises(StoreError) as err:
            store.find_api_key(SECRET_KEY)
    finally:
        store.close()
    assert hash_api_key(SECRET_KEY) not in str(err.value)
    assert "hidden" in str(err.value)
    # The same statement through an engine without the setting would print it:
    # what this test guards against is real.
    plain = create_engine(url)
    try:
        with plain.connect() as conn, pytest.raises(OperationalError) as raw:
            conn.execute(text("SELECT 1 FROM apikey WHERE key_hash = :h"), {"h": "visible-hash"})
    finally:
        plain.dispose()
    assert "visible-hash" in str(raw.value)


def test_raw_statement_errors_hide_parameters_too(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'llmgw.db'}")
    try:
        with store.engine.connect() as conn, pytest.raises(OperationalError) as err:
            conn.execute(text("INSERT INTO nowhere VALUES (:secret)"), {"secret": SECRET_KEY})
    finally:
        store.close()
    assert SECRET_KEY not in str(err.value)


def test_a_new_connection_leaves_the_locks_this_process_holds(tmp_path: Path) -> None:
    """SQLite's locks are POSIX record locks: closing any descriptor of the
    file drops all of the process's. Making a new connection's files private
    must not open them, or a second process takes the -shm for its own and
    truncates it under the first's mapping (SIGBUS in a commit)."""
    db = tmp_path / "s.db"
    first = Store(f"sqlite:///{db}")
    first.migrate()
    try:
        with first.engine.connect() as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")  # this process holds the write lock
            second = Store(f"sqlite:///{db}")
            try:
                with second.engine.connect():
                    pass  # the connect hook ran, on the same files
            finally:
                second.close()
            other = subprocess.run(
                [sys.executable, "-c", OTHER_WRITER, str(db)],
                capture_output=True,
                text=True,
                check=False,
            )
            assert other.returncode == 3, other.stderr  # still locked by this process
            conn.exec_driver_sql("ROLLBACK")
    finally:
        first.close()


OTHER_WRITER = """
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], timeout=0)
try:
    c.execute("BEGIN IMMEDIATE")
except sqlite3.OperationalError as exc:
    sys.exit(3 if "locked" in str(exc) else 4)
"""
