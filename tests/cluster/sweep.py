"""Removing beds: the owner's own teardown, and the sweep for beds left behind.

``python -m tests.cluster.sweep`` removes beds whose owner is gone (prints
what it removed); ``--all`` removes every bed, live or not, which CI does
after the tests, when nothing may be left.
"""

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from tests.cluster.names import (
    FILES_PREFIX,
    FILES_ROOT,
    LOCK_DIR,
    MARKER,
    NS_PREFIX,
    bed_of_link,
    bed_of_namespace,
    files_dir,
    lock_path,
    valid_bed_id,
)
from tests.cluster.system import links, namespace_pids, namespaces, sh


def bed_ids() -> set[str]:
    """Ids of every bed with a namespace, a link or a lock file on this machine."""
    found = {bed_of_namespace(ns) for ns in namespaces()} | {bed_of_link(n) for n in links()}
    if LOCK_DIR.is_dir():
        found |= {lock.stem for lock in LOCK_DIR.glob("*.lock") if valid_bed_id(lock.stem)}
    for place in FILES_ROOT.glob(f"{FILES_PREFIX}*"):
        if valid_bed_id(bed := place.name.removeprefix(FILES_PREFIX)):
            found.add(bed)
    return {bed for bed in found if bed}


def owner_alive(bed_id: str) -> bool:
    """Whether the bed's owner still holds its lock."""
    try:
        fd = os.open(lock_path(bed_id), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock if we took it
    return False


def marked_pids(bed_id: str) -> list[int]:
    """Live pids whose environment marks them as started in bed ``bed_id``."""
    needle = f"{MARKER}={NS_PREFIX}{bed_id}-".encode()
    found: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = b"\0" + (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"\0" + needle in environ:
            found.append(int(proc.name))
    return found


def remove_bed(bed_id: str, timeout_s: float = 10.0) -> None:
    """Kill the bed's processes, delete its namespaces, links and lock file.

    Processes first: a namespace outlives ``ip netns del`` while anything
    runs in it, and then its veth and addresses do too.
    """
    mine = [ns for ns in namespaces() if bed_of_namespace(ns) == bed_id]
    deadline = time.monotonic() + timeout_s
    while True:
        pids = {pid for ns in mine for pid in namespace_pids(ns)} | set(marked_pids(bed_id))
        pids.discard(os.getpid())
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for ns in mine:
        sh("ip", "netns", "del", ns, check=False)
    # Deleting a namespace removes its veth pairs, but asynchronously; the
    # bridge only goes when deleted.
    while True:
        left = [name for name in links() if bed_of_link(name) == bed_id]
        for name in left:
            sh("ip", "link", "del", name, check=False)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    shutil.rmtree(files_dir(bed_id), ignore_errors=True)
    lock_path(bed_id).unlink(missing_ok=True)


def sweep(everything: bool = False) -> list[str]:
    """Remove the beds whose owner is gone (all of them if ``everything``); their ids."""
    removed = [bed for bed in sorted(bed_ids()) if everything or not owner_alive(bed)]
    for bed in removed:
        remove_bed(bed)
    return removed


def main(argv: list[str]) -> int:
    """The command line: print each removed bed; 1 if any was removed."""
    removed = sweep(everything="--all" in argv)
    for bed in removed:
        print(f"removed network test bed {NS_PREFIX}{bed}")
    return 1 if removed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
