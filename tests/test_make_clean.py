"""``make clean`` removes this clone's directories in the system dir
(LLMGW_SYSTEM_DIR), which an agent run as root made for a work dir its engine
user could not reach, and leaves other clones' there. Run on a copy of the
Makefile in a stand-in clone: never on this checkout."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from worker_agent.system_dir import system_place

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("make") is None, reason="needs root and make"
)


def test_make_clean_removes_this_clones_system_dir_only(tmp_path: Path) -> None:
    clone, other = tmp_path / "clone", tmp_path / "other-clone"
    for top in (clone, other):
        (top / ".llmgw").mkdir(parents=True)
    shutil.copy(REPO / "Makefile", clone / "Makefile")
    (clone / ".venv").mkdir()
    system = tmp_path / "var-lib-llmgw"
    # As the agent makes them: a digest of the work dir, with its work-dir note.
    mine = system_place(system, clone / ".llmgw", "node-1", os.getgid()).parents[1]
    tests = system_place(system, clone / ".llmgw-test" / "w", "node-1", os.getgid()).parents[1]
    theirs = system_place(system, other / ".llmgw", "node-1", os.getgid()).parents[1]
    assert (mine / "work-dir").read_text() == f"{clone.resolve() / '.llmgw'}\n"

    env = {**os.environ, "LLMGW_SYSTEM_DIR": str(system)}
    done = subprocess.run(
        ["make", "-C", str(clone), "clean"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert not (clone / ".venv").exists() and not (clone / ".llmgw").exists()
    assert not mine.exists() and not tests.exists()
    assert theirs.is_dir() and (theirs / "work-dir").is_file()
    assert f"rm -rf {mine}" in done.stdout
