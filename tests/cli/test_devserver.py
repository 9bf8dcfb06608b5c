"""The embedded Temporal dev server refuses a second server on the same file."""

import os
import subprocess
import sys
from pathlib import Path

from tests.harness import DEVSERVER, free_port, start_devserver


def test_second_server_on_same_db_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    first = start_devserver(db, free_port(), tmp_path / "first.log")
    try:
        second = subprocess.run(
            [
                sys.executable,
                str(DEVSERVER),
                "--db",
                str(db),
                "--port",
                str(free_port()),
                "--headless",
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
            env=os.environ,
        )
        assert second.returncode == 3
        assert "refusing to start" in second.stderr
        assert first.alive()
    finally:
        first.stop()
    assert db.exists()
