"""The services a cluster runs beside llmgw, each on its own bed host:
the Temporal dev server, PostgreSQL and HAProxy.

Each is the real program, bound to its host's address (Temporal to
``0.0.0.0`` in a namespace holding only its host: the dev server dials its
internal services on loopback, so a non-loopback ``--ip`` breaks it), and
each can be stopped and started again on the same data, as a restart fault.
"""

import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg import sql

from llmgw_cli.procs import wait_for
from tests.cluster.hostproc import HostProcess
from tests.cluster.netbed import Bed
from tests.pg import PG_USER, find_bindir

REPO = Path(__file__).parents[2]
DEVSERVER = REPO / "temporal-dev" / "devserver.py"
TEMPORAL_PORT = 7233
TEMPORAL_UI_PORT = 8233
PG_PORT = 5432


class ServiceError(RuntimeError):
    """A bed service did not start."""


def reachable(address: str, port: int, timeout_s: float = 0.3) -> bool:
    """Whether ``address:port`` accepts a connection from here (the root namespace)."""
    with socket.socket() as s:
        s.settimeout(timeout_s)
        return s.connect_ex((address, port)) == 0


def _wait_listening(proc: HostProcess, address: str, port: int, what: str, log: Path) -> None:
    if not wait_for(lambda: reachable(address, port) or not proc.alive(), 90, interval_s=0.1):
        raise ServiceError(f"{what} did not listen on {address}:{port}:\n{_tail(log)}")
    if not proc.alive():
        raise ServiceError(f"{what} exited:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"


class Temporal:
    """The dev server on host ``temporal``, its UI too, with ``namespace`` made."""

    def __init__(self, bed: Bed, host: str, state: Path, namespace: str) -> None:
        self.bed, self.host, self.namespace = bed, host, namespace
        self.db = state / "temporal.db"
        self.log = state / "temporal.log"
        self.proc: HostProcess | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the frontend, as every process dials it."""
        return f"{self.bed.address(self.host)}:{TEMPORAL_PORT}"

    def start(self) -> None:
        """Start the server (again, on the same database, after ``stop``)."""
        argv = [sys.executable, str(DEVSERVER), "--db", str(self.db), "--ip", "0.0.0.0"]
        argv += ["--port", str(TEMPORAL_PORT), "--ui-port", str(TEMPORAL_UI_PORT)]
        argv += ["--namespace", self.namespace]
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.db.parent)}
        self.proc = self.bed.start(self.host, argv, env=env, log=self.log)
        _wait_listening(self.proc, self.bed.address(self.host), TEMPORAL_PORT, "Temporal", self.log)

    def stop(self) -> None:
        """Stop the server (SIGTERM), keeping its database."""
        if self.proc is not None:
            self.proc.stop(grace_s=10)
            self.proc = None


class Postgres:
    """PostgreSQL on host ``db``: role and database ``llmgw`` with a password
    (password auth from the bed's subnet), a libpq password file for clients."""

    def __init__(self, bed: Bed, host: str, state: Path) -> None:
        bindir = find_bindir()
        if bindir is None:
            raise ServiceError("PostgreSQL binaries not found (apt-get install postgresql)")
        self.bed, self.host, self.bindir = bed, host, bindir
        self.root = state
        self.data = state / "data"
        self.log = state / "postgres.log"
        self.password = secrets.token_urlsafe(18)
        self.proc: HostProcess | None = None

    @property
    def address(self) -> str:
        """The host's address, where the server listens."""
        return self.bed.address(self.host)

    def _as_postgres(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            ["runuser", "-u", PG_USER, "--", str(self.bindir / tool), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=dict(os.environ, LC_ALL="C"),
        )
        if done.returncode != 0:
            raise ServiceError(f"{tool} failed ({done.returncode}): {done.stderr[-2000:]}")

    def init(self) -> None:
        """initdb, the access rules, then start and make the role and database."""
        os.chown(self.root, *user_ids(PG_USER))
        self._as_postgres(
            "initdb", "-D", str(self.data), "-U", PG_USER, "-A", "trust",
            "--encoding=UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        subnet = self.address.rsplit(".", 1)[0] + ".0/24"
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\n"  # the harness's own setup, over the socket
            f"host llmgw llmgw {subnet} scram-sha-256\n"
        )
        self.start()
        with psycopg.connect(
            host=str(self.root), port=PG_PORT, user=PG_USER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE llmgw LOGIN PASSWORD {}").format(sql.Literal(self.password))
            )
            conn.execute("CREATE DATABASE llmgw OWNER llmgw")

    def start(self) -> None:
        """Start the server on its data (again, after ``stop``)."""
        argv = [
            *as_user(PG_USER), str(self.bindir / "postgres"), "-D", str(self.data),
            "-p", str(PG_PORT), "-k", str(self.root), "-c", f"listen_addresses={self.address}",
            # Durability of the store's disk is not under test here.
            "-c", "fsync=off", "-c", "max_connections=300",
        ]  # fmt: skip
        env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"}
        self.proc = self.bed.start(self.host, argv, env=env, log=self.log)
        _wait_listening(self.proc, self.address, PG_PORT, "PostgreSQL", self.log)
        # Listening is not accepting: until recovery ends, a connection is
        # refused with "the database system is starting up".
        if not wait_for(self._accepting, 60, interval_s=0.1):
            raise ServiceError(f"PostgreSQL did not accept connections:\n{_tail(self.log)}")
        if not self.proc.alive():
            raise ServiceError(f"PostgreSQL exited:\n{_tail(self.log)}")

    def _accepting(self) -> bool:
        """Whether a connection over the socket succeeds (or the server died)."""
        if self.proc is None or not self.proc.alive():
            return True
        try:
            psycopg.connect(
                host=str(self.root),
                port=PG_PORT,
                user=PG_USER,
                dbname="postgres",
                connect_timeout=5,
            ).close()
        except psycopg.OperationalError:
            return False
        return True

    def stop(self) -> None:
        """A fast shutdown (SIGINT: clients cut off at once), keeping the data."""
        if self.proc is not None:
            self.proc.signal(signal.SIGINT)
            if not wait_for(lambda: self.proc is None or not self.proc.alive(), 30):
                self.proc.stop(grace_s=1)
            self.proc.popen.wait(10)
            self.proc = None

    def passfile_line(self) -> str:
        """The libpq password file's line for the llmgw role."""
        return f"{self.address}:{PG_PORT}:llmgw:llmgw:{self.password}\n"


def user_ids(user: str) -> tuple[int, int]:
    """The uid and gid of ``user``."""
    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def as_user(user: str) -> list[str]:
    """The prefix that execs a command as ``user`` with its groups, the
    environment kept (as systemd's ``User=`` does), no process in between."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--"]


class Haproxy:
    """HAProxy on host ``lb``, from the configuration given."""

    def __init__(self, bed: Bed, host: str, state: Path, config: str, port: int) -> None:
        self.bed, self.host, self.port = bed, host, port
        self.config = state / "haproxy.cfg"
        self.config.write_text(config)
        self.log = state / "haproxy.log"
        self.proc: HostProcess | None = None

    def start(self) -> None:
        """Check the configuration, then run HAProxy in the foreground."""
        env = {"PATH": os.environ.get("PATH", "")}
        check = self.bed.run(self.host, ["haproxy", "-c", "-f", str(self.config)], env=env)
        if check.returncode != 0:
            raise ServiceError(f"haproxy -c: {check.stdout}{check.stderr}")
        self.proc = self.bed.start(
            self.host, ["haproxy", "-db", "-f", str(self.config)], env=env, log=self.log
        )
        _wait_listening(self.proc, self.bed.address(self.host), self.port, "HAProxy", self.log)
