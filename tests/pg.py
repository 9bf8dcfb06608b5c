"""A throwaway PostgreSQL cluster for tests, from the installed binaries.

``initdb`` and ``pg_ctl`` from the Debian package (``apt-get install
postgresql``) make a cluster in a temp dir, listening on a free loopback port
with its socket in that dir, so tests depend on no system service. PostgreSQL
refuses to run as root: as root the cluster runs as the ``postgres`` user the
package creates.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import psycopg
import pytest
from psycopg import sql

from tests.bench.procs import free_port

PG_USER = "postgres"


def find_bindir() -> Path | None:
    """The newest installed PostgreSQL's bin dir (or the one on PATH), if any."""

    def version(initdb: Path) -> int:
        found = re.search(r"/(\d+)/bin/initdb$", str(initdb))
        return int(found.group(1)) if found else 0

    installed = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=version)
    if installed:
        return installed[-1].parent
    on_path = shutil.which("initdb")
    return Path(on_path).resolve().parent if on_path else None


class PgCluster:
    """A running cluster; ``create_database`` gives each test its own database."""

    def __init__(self, bindir: Path, port: int) -> None:
        self.bindir = bindir
        self.port = port
        self.root = Path(tempfile.mkdtemp(prefix="llmgw-test-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                shutil.chown(self.root, PG_USER)
            except LookupError:
                shutil.rmtree(self.root)
                raise RuntimeError(
                    "running as root and there is no `postgres` user to run PostgreSQL as"
                    " (apt-get install postgresql creates it)"
                ) from None
            self._as = ["runuser", "-u", PG_USER, "--"]

    def _pg(self, tool: str, *args: str) -> None:
        with open(self.root / f"{tool}.out", "ab") as out:
            done = subprocess.run(
                [*self._as, str(self.bindir / tool), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=120,
                check=False,
                env=dict(os.environ, LC_ALL="C"),
            )
        if done.returncode != 0:
            tail = (self.root / f"{tool}.out").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}):\n{tail}")

    def start(self) -> None:
        """initdb, then start and wait until it accepts connections."""
        self._pg(
            "initdb", "-D", str(self.data), "-U", PG_USER, "-A", "trust",
            "--encoding=UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        self.run()

    def run(self) -> None:
        """Start the server on its data (again, after ``halt``) and wait for it."""
        # Durability is not under test: no fsync keeps the slow CI disk out of it.
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            " -c max_connections=200"
        )
        try:
            self._pg("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log),
                     "-w", "-t", "60", "-o", options)  # fmt: skip
        except RuntimeError as exc:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            self.stop()
            raise RuntimeError(f"{exc}\n{log}") from None

    def halt(self) -> None:
        """Stop the server, clients cut off at once, keeping its data (``run``
        starts it again). A fast shutdown, not an immediate one: with
        synchronous_commit off, an immediate one loses the last commits."""
        self._pg("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w")

    def stop(self) -> None:
        """Stop the server and remove everything it wrote."""
        if (self.data / "postmaster.pid").exists():
            self._pg("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")
        shutil.rmtree(self.root, ignore_errors=True)

    def pids(self) -> list[int]:
        """The postmaster and every backend and helper process it forked (to freeze)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        pids = [postmaster]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                pids.append(int(entry.name))
        return pids

    def url(self, database: str) -> str:
        """The store URL of ``database`` (trust auth on loopback: no password)."""
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its store URL."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)


@contextlib.contextmanager
def own_cluster() -> Iterator[PgCluster]:
    """A PostgreSQL server of a test's own, to freeze or stop (skipped where
    LLMGW_TEST_ALLOW_NO_PG=1 and there are no binaries; failed otherwise)."""
    bindir = find_bindir()
    if bindir is None:
        if os.environ.get("LLMGW_TEST_ALLOW_NO_PG") == "1":
            pytest.skip("no PostgreSQL binaries and LLMGW_TEST_ALLOW_NO_PG=1")
        pytest.fail(
            "PostgreSQL binaries not found (apt-get install postgresql);"
            " set LLMGW_TEST_ALLOW_NO_PG=1 to skip the PostgreSQL tests locally"
        )
    cluster = PgCluster(bindir, free_port())
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


class _Rollback(Protocol):
    def rollback(self) -> None: ...


@contextlib.contextmanager
def frozen(cluster: PgCluster, then: _Rollback) -> Iterator[None]:
    """Every PostgreSQL process of ``cluster`` stopped (SIGSTOP) for the
    block; resumed after, then ``then``'s transaction (the lock that held
    the store call the test freezes in) rolled back."""
    pids = cluster.pids()
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # a backend just gone
                os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        then.rollback()
