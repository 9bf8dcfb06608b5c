"""Usage the store has not taken yet, kept on local disk (LLMGW_USAGE_SPOOL_DIR).

The Accountant writes usage in batches every second. While the store is
down those batches pile up in memory, for as long as the outage lasts (known
keys go on being served: router/auth.py), and a router killed then lost
them all: the outage's requests were never billed. So after a flush that
could not write everything, the usage still pending is saved here, and
removed once a flush has written it all.

One directory per store (``spool_dir``), in it one file per router process
that has usage kept: ``<router id>.json`` (replaced whole: written aside,
then renamed over), beside ``<router id>.lock``, which the process holds
locked (``flock``) from its first save until the spool is cleared. A router
starting takes over every spool whose lock it can take (its router is
gone): it queues that usage as its own, saves it in its own spool, then
removes the old one. A router killed elsewhere leaves its spool on its host,
for the next router started there on the same store.

Exactness: a router killed between the store committing a row and the
spool being rewritten (one flush, milliseconds) bills that row again on
replay; anything else is billed once.
"""

import fcntl
import hashlib
import logging
import os
import re
from pathlib import Path

from pydantic import BaseModel, TypeAdapter

from router.usage import UsageDelta, UsageKey

log = logging.getLogger(__name__)

Pending = dict[UsageKey, UsageDelta]


class SpooledUsage(BaseModel):
    """One usage row's pending delta, as the spool file holds it."""

    key_id: int
    model: str
    day: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int


_FILE = TypeAdapter(list[SpooledUsage])


def _dump(pending: Pending) -> bytes:
    return _FILE.dump_json(
        [
            SpooledUsage(
                key_id=k.key_id,
                model=k.model,
                day=k.day,
                requests=d.requests,
                errors=d.errors,
                prompt_tokens=d.prompt_tokens,
                completion_tokens=d.completion_tokens,
            )
            for k, d in pending.items()
        ]
    )


def _load(data: bytes, into: Pending) -> None:
    for row in _FILE.validate_json(data):
        delta = UsageDelta(row.requests, row.errors, row.prompt_tokens, row.completion_tokens)
        key = UsageKey(row.key_id, row.model, row.day)
        into.setdefault(key, UsageDelta()).add(delta)


def spool_dir(base: Path, store_url: str) -> Path:
    """The spool directory for routers of one store: a router takes over only
    usage that was meant for the store it writes to."""
    return base / hashlib.sha256(store_url.encode()).hexdigest()[:16]


class UsageSpool:
    """This router's spool in ``directory`` (``spool_dir``): files exist
    only while there is usage kept, so a router that never needed the spool
    leaves nothing behind."""

    def __init__(self, directory: Path, owner: str) -> None:
        self._dir = directory
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", owner)  # a router id, as a file name
        self._data = directory / f"{name}.json"
        self._lock = directory / f"{name}.lock"
        self._fd: int | None = None

    def open(self) -> Pending:
        """Take over the spools of routers that are gone; what they held (to
        queue for the store)."""
        if not self._dir.is_dir():
            return {}
        taken: Pending = {}
        orphans: list[tuple[Path, int]] = []
        for lock in sorted(self._dir.glob("*.lock")):
            try:
                fd = os.open(lock, os.O_RDWR)
            except FileNotFoundError:
                continue  # its router has just cleared it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # its router runs: its spool is its own
                continue
            data = lock.with_suffix(".json")
            if data.exists():
                _load(data.read_bytes(), taken)
            if lock == self._lock:
                self._fd = fd  # left by an earlier run under this router id: ours
            else:
                orphans.append((lock, fd))
        if taken:
            self.save(taken)  # ours before theirs go: nothing is lost in between
            log.info("took over the usage of stopped routers from %s", self._dir)
        else:
            self.clear()  # an earlier run's empty lock, if any
        for lock, fd in orphans:
            lock.with_suffix(".json").unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
            os.close(fd)
        return taken

    def save(self, pending: Pending) -> None:
        """Keep ``pending`` (all of it: it replaces what was kept)."""
        if self._fd is None:
            # The lock first: from now on no other router takes this spool.
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self._lock, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._fd = fd
        aside = self._data.with_suffix(".json.tmp")
        with open(os.open(aside, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "wb") as f:
            f.write(_dump(pending))
            f.flush()
            os.fsync(f.fileno())
        os.replace(aside, self._data)

    def clear(self) -> None:
        """Everything kept has reached the store: the files go (the data first)."""
        if self._fd is not None:
            self._data.unlink(missing_ok=True)
            self._lock.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Let go of the lock; what is kept stays, for the next router."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
