"""Usage the store has not taken yet, kept on local disk (LLMGW_USAGE_SPOOL_DIR).

The Accountant writes usage in batches every second. Between two flushes,
and for as long as a store outage lasts (known keys go on being served:
router/api/auth.py), the usage owed is in memory, and a router killed then
lost it: its answered requests were never billed. So each finished request
is noted in a journal here (``note``: one append, no fsync, when the request
ends: for a stream, just after its last chunk, so a router killed in
between has sent an answer it never bills), the usage owed is saved here at
each flush that leaves any (replacing the journals it holds: every one
before the save's generation, those of an earlier save that failed
included), and all of it is removed once nothing is owed (after any save
still running: saves and clears run in order in the spool's own thread).

One directory per store (``spool_dir``), in it one spool per router process
that has usage kept: ``<router id>-<nonce>.json`` (replaced whole: written
aside, then renamed over) and its journals ``<router id>-<nonce>.<n>.adds``
(one row a line), beside its ``.lock``, which the process holds locked
(``flock``) from its first note or save until the spool is cleared (a new
nonce each time). A router starting takes over every spool whose lock it can
take (its process is gone): it queues that usage as its own, saves it in its
own spool, then removes the old one (a router killed while clearing its
spool may leave files without a lock: nothing in them is owed, and no router
takes them over). A spool left by a router on another host
waits for the next router started on that host with the same store. Keep the
directory on a local disk: ``flock`` over NFS is not a lock to rely on.

Exactness: usage is billed once, except when a router dies after the store
committed some of a flush's rows and before the spool was rewritten (the
length of one flush's writes and the save after it: under traffic, a few
milliseconds of every flush interval), or while taking a spool over (between
saving it as its own and removing the old one): those rows are billed again.
A host that loses power loses what was noted since the last save; every
rename and removal is fsynced, so none brings back usage already billed.

Trust: the next router bills whatever a spool holds, so the directory must
be this router's own. It is made 0700; one that is a symlink, owned by
another user, or writable by its group or others is refused (PermissionError:
no spool is read or written there), files are opened with ``O_NOFOLLOW``,
and a file with a negative count or a damaged line (other than a journal's
last: a write cut short) is set aside whole as ``.bad``, none of it billed.
A journal write the disk cuts short ends that journal (the next row starts
a new one), so it costs only its own row.
"""

import errno
import fcntl
import glob
import hashlib
import logging
import os
import re
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter, ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from router.billing.usage import UsageDelta, UsageKey, UsageRow

log = logging.getLogger(__name__)

Pending = dict[UsageKey, UsageDelta]


# On disk: the rows' pending deltas, in the admin API's usage row shape.
_FILE = TypeAdapter(list[UsageRow])


def _dump(pending: Pending) -> bytes:
    return _FILE.dump_json(
        [
            UsageRow(
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


def read(path: Path) -> Pending:
    """What one spool file holds (raises OSError or ValidationError when it
    cannot be read)."""
    out: Pending = {}
    _load(_read_nofollow(path), out)
    return out


def _load_spool(data: bytes) -> Pending:
    out: Pending = {}
    _load(data, out)
    return out


def _merge(into: Pending, part: Pending) -> None:
    for key, delta in part.items():
        into.setdefault(key, UsageDelta()).add(delta)


def _read_nofollow(path: Path) -> bytes:
    """The file's bytes; a symlink is refused (ELOOP), not followed."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
        return f.read()


def check_dir(directory: Path) -> None:
    """Refuse (PermissionError) a spool directory another user could plant
    usage in: a symlink, not owned by this process's user, or writable by
    its group or by others."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"usage spool {directory} is not a directory (a symlink?)")
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"usage spool {directory} is owned by uid {st.st_uid}, not this router's"
            f" ({os.geteuid()})"
        )
    if st.st_mode & 0o022:
        raise PermissionError(
            f"usage spool {directory} is writable by its group or others"
            f" (mode {stat.S_IMODE(st.st_mode):o}): make it 0700"
        )


def _load_journal(data: bytes) -> Pending:
    """What one journal holds; all of it or, where a line other than the
    last cannot be read, none of it (ValidationError: the caller sets the
    journal aside whole, so what it says is billed never and not half)."""
    # One row a line, appended by ``UsageSpool.note``. A last line cut short
    # (a write the disk cut short, which ends that journal, or the host lost
    # power mid-write: never fsynced, never promised) is skipped.
    out: Pending = {}
    lines = data.split(b"\n")
    for number, line in enumerate(lines):
        if not line:
            continue
        try:
            row = UsageRow.model_validate_json(line)
        except ValidationError:
            if number == len(lines) - 1:
                continue
            raise
        delta = UsageDelta(row.requests, row.errors, row.prompt_tokens, row.completion_tokens)
        out.setdefault(UsageKey(row.key_id, row.model, row.day), UsageDelta()).add(delta)
    return out


def _load(data: bytes, into: Pending) -> None:
    # UsageRow's counts are >= 0: a negative one fails validation (never
    # billed). The whole file is validated before any row is added.
    for row in _FILE.validate_json(data):
        delta = UsageDelta(row.requests, row.errors, row.prompt_tokens, row.completion_tokens)
        key = UsageKey(row.key_id, row.model, row.day)
        into.setdefault(key, UsageDelta()).add(delta)


def spool_dir(base: Path, store_url: str) -> Path:
    """The spool directory for routers of one store: a router takes over only
    usage that was meant for the store it writes to. Named by a digest of the
    URL without its password (a rotated password is the same store)."""
    try:
        url = make_url(store_url)._replace(password=None).render_as_string(hide_password=False)
    except ArgumentError:
        url = store_url
    return base / hashlib.sha256(url.encode()).hexdigest()[:16]


def _fsync_dir(directory: Path) -> None:
    """A rename or removal in ``directory`` made durable (a power loss must
    not bring back a spool already billed)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _journals(directory: Path, stem: str) -> list[tuple[int, Path]]:
    """The journals of the spool ``stem`` in ``directory``, by generation
    (matched whole: ``<stem>.*.adds`` would also match another spool whose
    router id starts with this one's name and a dot)."""
    pattern = re.compile(re.escape(stem) + r"\.([0-9]+)\.adds")
    found = []
    for path in directory.glob(f"{glob.escape(stem)}.*.adds"):
        if match := pattern.fullmatch(path.name):
            found.append((int(match[1]), path))
    return sorted(found)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _lock(path: Path, create: bool) -> int | None:
    """``path`` opened and locked; None when another process holds it or it
    is gone (removed between the open and the lock: that file is not the
    spool's lock any more)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        log.warning("usage spool %s is a symlink: not followed", path)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(fd)
        now = os.stat(path)
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            raise FileNotFoundError(path)
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    return fd


@dataclass(frozen=True)
class _Files:
    """The file names of one holding of a spool, from the lock taken to the
    spool cleared. The next holding has names of its own, so what a save or
    a clear still running in the spool's thread does to these never touches
    files noted after it."""

    directory: Path
    stem: str

    @classmethod
    def new(cls, directory: Path, name: str) -> "_Files":
        # The router id names it for people; the nonce keeps two processes
        # with one id (PID 1 in two containers) from sharing a file.
        return cls(directory, f"{name}-{uuid.uuid4().hex[:8]}")

    @property
    def data(self) -> Path:
        return self.directory / f"{self.stem}.json"

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.stem}.lock"

    def journal(self, gen: int) -> Path:
        return self.directory / f"{self.stem}.{gen}.adds"

    def save(self, pending: Pending, upto: int | None) -> None:
        aside = self.data.with_suffix(".json.tmp")
        flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(aside, flags, 0o600), "wb") as f:
            f.write(_dump(pending))
            f.flush()
            os.fsync(f.fileno())
        os.replace(aside, self.data)
        _fsync_dir(self.directory)
        if upto is not None:
            # Every journal before ``upto``, those of an earlier save that
            # failed included: what this save holds has all they noted.
            replaced = [p for gen, p in _journals(self.directory, self.stem) if gen < upto]
            for journal in replaced:
                journal.unlink(missing_ok=True)
            if replaced:
                # Durable too: back after a power loss, beside the spool that
                # holds their usage, they would be billed twice.
                _fsync_dir(self.directory)

    def clear(self, fd: int) -> None:
        """The files go, then the lock is let go. The lock file first: a
        router killed part-way leaves files no router takes over (spools
        are found by their locks), not usage already billed to bill again."""
        try:
            self.lock.unlink(missing_ok=True)
            self.data.unlink(missing_ok=True)
            self.data.with_suffix(".json.tmp").unlink(missing_ok=True)
            for _, journal in _journals(self.directory, self.stem):
                journal.unlink(missing_ok=True)
            _fsync_dir(self.directory)
        finally:
            os.close(fd)


class UsageSpool:
    """This router's spool in ``directory`` (``spool_dir``): files exist
    only while there is usage kept, so a router that never needed the spool
    leaves nothing behind.

    ``note``, ``rotate`` and the ``saving``/``clearing``/``closing`` calls
    run where no two run at once (the event loop); the jobs the last three
    return run in order in one thread of their own (blocking file work off
    the loop), each on the files held when it was made."""

    def __init__(self, directory: Path, owner: str) -> None:
        self._dir = directory
        self._name = re.sub(r"[^A-Za-z0-9_.-]", "_", owner)
        # The names of the holding now, or of the next one while none is.
        self._files = _Files.new(directory, self._name)
        self._fd: int | None = None
        # The journal of usage noted since the last save (``note``): one
        # file a generation, so a save can drop exactly the ones it holds.
        self._gen = 0
        self._journal: int | None = None

    def hold(self) -> None:
        """Take this spool's lock (made if missing): from now on no other
        router takes it over."""
        if self._fd is None:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_dir(self._dir)
            self._fd = _lock(self._files.lock, create=True)
            if self._fd is None:
                raise OSError(f"{self._files.lock} is locked by another process")

    def _held(self) -> _Files:
        self.hold()
        return self._files

    def note(self, key: UsageKey, delta: UsageDelta) -> None:
        """Append one finished request's usage to the journal: in the kernel
        (no fsync) when the request ends, so a router killed (SIGKILL, OOM)
        before its next flush loses none of its finished requests. A host
        losing power loses at most what was noted since the last save (one
        flush interval)."""
        if self._journal is None:
            path = self._held().journal(self._gen)
            flags = os.O_CREAT | os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            self._journal = os.open(path, flags, 0o600)
        row = UsageRow(
            key_id=key.key_id,
            model=key.model,
            day=key.day,
            requests=delta.requests,
            errors=delta.errors,
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=delta.completion_tokens,
        )
        try:
            _write_all(self._journal, row.__pydantic_serializer__.to_json(row) + b"\n")
        except OSError:
            # Part of the row may be in (the disk full mid-write): the next
            # row goes to a new journal, so this part is its journal's last
            # line, skipped when read, and glued to no other row.
            self.rotate()
            raise

    def rotate(self) -> int:
        """Start a new journal; the generation before which journals are
        closed (for ``save`` to drop once what it saves holds everything
        they noted)."""
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None
        self._gen += 1
        return self._gen

    def open(self) -> Pending:
        """Take over the spools of routers that are gone; what they held (to
        queue for the store)."""
        if not os.path.lexists(self._dir):
            return {}
        check_dir(self._dir)
        taken: Pending = {}
        orphans: list[tuple[Path, int]] = []
        for lock in sorted(self._dir.glob("*.lock")):
            fd = _lock(lock, create=False)
            if fd is None:
                continue  # its router runs (or has just cleared it)
            orphans.append((lock, fd))
            data = lock.with_suffix(".json")
            for part, load in [
                (data, _load_spool),
                *((j, _load_journal) for _, j in _journals(self._dir, lock.stem)),
            ]:
                try:
                    if os.path.lexists(part):
                        _merge(taken, load(_read_nofollow(part)))
                except (OSError, ValidationError) as exc:
                    # Not ours to read (damaged, another version): set aside
                    # whole, none of it billed, and the routers still start.
                    log.warning("usage spool %s unreadable, set aside as .bad: %s", part, exc)
                    bad = ".bad" if part == data else part.suffix + ".bad"
                    part.rename(part.with_suffix(bad))
        if taken:
            self.save(taken)  # ours before theirs go: nothing is lost in between
            log.info("took over the usage of stopped routers from %s", self._dir)
        for lock, fd in orphans:
            for _, journal in _journals(self._dir, lock.stem):
                journal.unlink()
            lock.with_suffix(".json").unlink(missing_ok=True)
            lock.with_suffix(".json.tmp").unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
            os.close(fd)
        if orphans:
            _fsync_dir(self._dir)
        return taken

    def saving(self, pending: Pending, upto: int | None = None) -> Callable[[], None]:
        """The save of ``pending`` (all of it: it replaces what was kept, and
        the journals before generation ``upto``, which it must hold all of),
        as a job on the files held now (the lock taken first)."""
        files = self._held()
        return lambda: files.save(pending, upto)

    def save(self, pending: Pending, upto: int | None = None) -> None:
        """``saving``'s job, run at once."""
        self.saving(pending, upto)()

    @property
    def kept(self) -> bool:
        """Whether this router has usage kept (files on disk)."""
        return self._fd is not None

    def clearing(self) -> Callable[[], None] | None:
        """Everything kept has reached the store: the spool is let go at
        once (a later ``note`` starts new files) and its files go in the job
        returned (None: nothing was kept), to run after any save before it."""
        if self._fd is None:
            return None
        self.rotate()
        fd, files = self._fd, self._files
        self._fd, self._files = None, _Files.new(self._dir, self._name)
        return lambda: files.clear(fd)

    def clear(self) -> None:
        """``clearing``'s job, run at once."""
        if (job := self.clearing()) is not None:
            job()

    def closing(self) -> Callable[[], None] | None:
        """Let go of the spool (what is kept stays, for the next router); the
        lock goes in the job returned (None: none held), to run after any
        save before it: let go earlier, the spool could be taken over while
        that save still writes it."""
        self.rotate()
        if self._fd is None:
            return None
        fd = self._fd
        self._fd, self._files = None, _Files.new(self._dir, self._name)
        return lambda: os.close(fd)

    def close(self) -> None:
        """``closing``'s job, run at once."""
        if (job := self.closing()) is not None:
            job()
