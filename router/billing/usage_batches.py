"""Usage queued in memory and written to the store a batch at a time; until
the store has taken it, kept in the spool (router/billing/usage_spool.py):
each request noted in its journal when queued, what is owed saved at each
flush.

A batch is written by a worker thread (``router.billing.usage.record``: each row
leaves the batch once committed). ``flush`` waits for it at most
``WRITE_WAIT_S`` and never abandons it: a store that froze holds the thread
until it answers, and the batch comes back to the queue only once the thread
has finished, less the rows it committed. Meanwhile no second batch starts
(it could be billed twice), and the usage owed (the batch in the thread and
the queue) is saved in the spool at each flush. A router killed while the
store is frozen or down leaves it there for the next.

The spool is removed once nothing is owed: no batch in its thread, none
failed, nothing queued.
"""

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from llmgw.store import Store
from router.billing.usage import UsageDelta, UsageKey, record
from router.billing.usage_spool import Pending, UsageSpool
from router.common.blocking import Warnings

log = logging.getLogger(__name__)

# The longest a flush waits for a batch's write; it goes on in its thread.
WRITE_WAIT_S = 5.0


class UsageBatches:
    """The usage queue, its one write at a time, and its spool (None: no spool)."""

    def __init__(
        self, store: Store, spool: UsageSpool | None = None, write_wait_s: float = WRITE_WAIT_S
    ) -> None:
        self._store = store
        self._spool = spool
        self._wait = write_wait_s
        self._warnings = Warnings(log)
        self._queued: Pending = defaultdict(UsageDelta)
        self._writing: Pending = {}  # the batch in the thread (rows leave as committed)
        self._write: asyncio.Future[None] | None = None
        self._failed = False  # the last batch left rows unwritten
        # Spool files are written by a thread of their own: never queued
        # behind store calls stuck in the default pool.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="usage-spool")

    def add(self, key: UsageKey, delta: UsageDelta) -> None:
        """Queue ``delta``, and note it in the spool's journal (one write to
        a local file, never the store): when the request ends (for a stream,
        just after its last chunk was sent)."""
        self._queued[key].add(delta)
        if self._spool is not None:
            try:
                self._spool.note(key, delta)
            except OSError as exc:
                self._warnings.warn("usage spool: %s", exc)

    async def open(self) -> None:
        """Queue what routers stopped during a store outage left in the spool."""
        if self._spool is not None:
            taken = await asyncio.get_running_loop().run_in_executor(self._io, self._spool.open)
            for key, delta in taken.items():
                self._queued[key].add(delta)

    async def flush(self) -> None:
        """Start a batch unless one is still being written; wait for it within
        the bound; then keep the spool true to what is owed."""
        if self._write is None and self._queued:
            self._start()
        if self._write is not None:
            await asyncio.wait([self._write], timeout=self._wait)  # never cancels it
        await self._keep()

    def _start(self) -> None:
        batch, self._queued = dict(self._queued), defaultdict(UsageDelta)
        self._writing = batch
        write = asyncio.ensure_future(asyncio.to_thread(record, self._store, batch))
        write.add_done_callback(lambda done: self._written(done, batch))
        self._write = write

    def _written(self, write: "asyncio.Future[None]", batch: Pending) -> None:
        self._write, self._writing = None, {}
        if not write.cancelled() and (exc := write.exception()) is not None:
            log.warning("usage write failed, will retry: %s", exc)
        # What did not land goes before what was queued since: a router's
        # rows land in the order it queued them, so a row billed means every
        # row it queued before is billed (the cluster tests fence on that).
        queued, self._queued = self._queued, defaultdict(UsageDelta, batch)
        for key, delta in queued.items():
            self._queued[key].add(delta)
        self._failed = bool(batch)

    async def _keep(self) -> None:
        spool = self._spool
        if spool is None:
            return
        try:
            if self._write is not None or self._failed or self._queued:
                # The snapshot and the journal's rotation together, on the
                # loop: the journals it closes hold nothing it lacks.
                upto = spool.rotate()
                owed: Pending = defaultdict(UsageDelta)
                for part in (self._writing.copy(), self._queued):
                    for key, delta in part.items():
                        owed[key].add(replace(delta))
                await self._in_io(spool.saving(dict(owed), upto))
            elif (clear := spool.clearing()) is not None:
                # Nothing owed: the files go, in the spool's thread after any
                # save still running there (a flush cancelled mid-save leaves
                # its save running: cleared before it lands, that save would
                # leave a spool of usage already billed).
                await self._in_io(clear)
        except OSError as exc:
            # The journals a failed save was to replace stay, and the next
            # save replaces them too.
            self._warnings.warn("usage spool: %s", exc)

    async def _in_io(self, job: Callable[[], None]) -> None:
        # The spool's jobs run one at a time, in the order given.
        await asyncio.get_running_loop().run_in_executor(self._io, job)

    async def close(self) -> None:
        """After the last flush: what is owed stays in the spool, for the next
        router. A write still in its thread is waited for first, however long
        (the process cannot exit before that thread ends anyway): let go
        earlier, the spool could be taken over and billed while the write
        lands too. Killed meanwhile (the shutdown watchdog), the lock goes
        with the process and the write with its connection."""
        if self._write is not None:
            await asyncio.wait([self._write])
            await self._keep()
        if self._spool is not None and (let_go := self._spool.closing()) is not None:
            await self._in_io(let_go)  # after any save still running
        self._io.shutdown(wait=True)
