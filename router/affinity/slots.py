"""llama.cpp slot pinning: each conversation keeps one engine slot of its replica.

Why (docs/guides/routing.md, "llama.cpp slots"): a llama-server gives a
request the idle slot whose last prompt shares the most with it. When
conversations share a long system prompt, a new conversation's first turn
shares most with *another* conversation's slot and overwrites its history
(its f_keep is high, so the history is not even saved to the host-RAM
cache): each conversation keeps only the system prompt, whatever the router
does. Measured: two conversations alternating on one server kept 1,044 of
1,289 tokens; pinned (``id_slot``) with ``--no-cache-idle-slots``, every
turn found its whole previous prompt cached.

So with ``routing.slots: N`` on a llama.cpp model the replica runs ``N``
slots that are never cleared while idle, and the router sends each request
with ``id_slot``: the conversation's own slot when idle, else a slot no
conversation holds (the conversation's rendezvous order, so routers that
never talked tend to agree), else the least recently used idle one. A
router sends a replica no more requests at once than it has slots to pin
(``Affinity.inflight_cap``): the rest wait in its queue, in admission
order. (Sent unpinned, a request would take a slot of the engine's
choosing, which the router might then pin another request to while busy.)
A request finds every slot busy only when slots are blocked (below): it
then goes unpinned.

A router knows only its own requests: two routers may pin different
conversations to one slot, and a request pinned to a slot another
router's request holds is queued by llama.cpp behind it (its deferred-by-id
path, which has left requests unfinished and the engine spinning in our
benchmark). So several routers in front of one slots model each take a
share of the slots (``LLMGW_SLOT_SHARE`` of ``LLMGW_SLOT_SHARES``, router
settings; :class:`SlotShare`): router ``i`` of ``n`` pins only slots
``s`` with ``s % n == i``, so no two routers ever pin the same slot. A
conversation whose turns alternate between routers then keeps one slot per
router, each a turn behind: its turns compute two turns' new tokens, not
one.

Nor does it see a request that holds a slot and never finishes (another
router's, or one the engine itself never completes): llama.cpp queues a
request for a busy slot however long that slot stays busy. So a pinned
request that waited ``STUCK_S`` and ended without a byte from the engine
(its client gave up, or the connection broke) leaves its slot out of this
router's choices for ``BLOCK_S`` (logged): the conversation moves to
another slot (one prefill of its history) instead of queueing behind the
same request turn after turn. The request that waited is not moved: it
waits until its client gives up (or the engine answers it). This router's
own request on a slot, however long it runs, keeps the slot busy, so out of
its choices, until it ends (a whole answer is awaited even when its client
has gone: router/api/openai.py ``_generates_on``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.affinity.policy import rendezvous

log = logging.getLogger(__name__)

# Replicas' slot tables kept per router (cleared past this: replicas come and go).
MAX_TABLES = 10_000
# A pinned request that waited this long without the engine's first byte
# (llama.cpp sends a stream's headers with its first token, a whole answer
# at its end) and then ended without one was queued behind a request this
# router does not know: far past a turn's prefill on CPU, or a wait behind
# another router's turn on the same slot; a client that gave up sooner
# proves nothing.
STUCK_S = 30.0
# How long such a slot is left out of this router's choices. Long: the
# request holding it may never finish (one held its slot 20 minutes in a
# benchmark, until its run was stopped), and each try after the block
# costs a request its whole wait until its client gives up (the bench's
# clients: 600 s). A slot left out wrongly costs less: this router pins
# its conversations to the others (the engine may still give it an unpinned
# request), and a replica forgotten (drained, stopped, restarted) starts afresh.
BLOCK_S = 1800.0


@dataclass(frozen=True, slots=True)
class SlotShare:
    """The slots this router pins: slot ``s`` is its own when ``s % count ==
    index`` (router settings ``slot_share`` of ``slot_shares``). One router:
    every slot."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"slot share {self.index} of {self.count}: needs 0 <= share < shares")

    def of(self, slots: int) -> list[int]:
        """This router's slots of a replica running ``slots``."""
        return list(range(self.index, slots, self.count))


EVERY_SLOT = SlotShare()


@dataclass(slots=True)
class _Slot:
    owner: int | None = None  # the conversation (PromptKey.lead) it last served
    used: int = -1  # when it was last pinned (a tick; -1: never)
    busy: int = 0  # this router's requests on it now
    since: float = 0.0  # when its last request was pinned (the clock's time)
    head: int | None = None  # the head (system prompt) its last prompt opened with
    tokens: int = 0  # its last prompt's estimated tokens (what a copy of it moves)
    blocked_until: float = float("-inf")  # left out of the choices until then


class SlotTable:
    """One replica's engine slots as this router has pinned them."""

    def __init__(
        self,
        slots: int,
        clock: Callable[[], float] = time.monotonic,
        stuck_s: float = STUCK_S,
        block_s: float = BLOCK_S,
        share: SlotShare = EVERY_SLOT,
    ) -> None:
        self._slots = [_Slot() for _ in range(slots)]
        # The slots this router may pin (the others are other routers').
        self._mine = share.of(slots)
        self._tick = 0
        self._names = [str(i) for i in range(slots)]
        self._clock = clock
        self._stuck_s = stuck_s
        self._block_s = block_s

    @property
    def size(self) -> int:
        return len(self._slots)

    def pin(self, conversation: int) -> int | None:
        """The slot for a request of ``conversation`` (counted busy until
        :meth:`release`), or None: every slot of this router's share is busy
        with its requests or blocked (STUCK_S), or its share is empty.

        A slot is the conversation's when its last request was (questions on
        one document sent at once fill several): the idle one used last.
        """
        now = self._clock()
        idle = [i for i in self._mine if self._free(i, now)]
        if not idle:
            return None
        own = [i for i in idle if self._slots[i].owner == conversation]
        if own:
            return self._take(max(own, key=lambda i: self._slots[i].used), conversation)
        free = [self._names[i] for i in idle if self._slots[i].owner is None]
        if free:
            return self._take(int(rendezvous(conversation, free)[0]), conversation)
        return self._take(min(idle, key=lambda i: self._slots[i].used), conversation)

    def release(self, slot: int, answered: bool) -> float:
        """A request pinned to ``slot`` ended; ``answered``: the engine sent
        its first byte. One that waited ``stuck_s`` and got none leaves the
        slot out for ``block_s``: how long it waited then (0: not blocked)."""
        if not 0 <= slot < len(self._slots):
            return 0.0
        entry = self._slots[slot]
        if entry.busy > 0:
            entry.busy -= 1
        now = self._clock()
        waited = now - entry.since
        if answered or waited < self._stuck_s:
            return 0.0
        entry.blocked_until = now + self._block_s
        return waited

    def block(self, slot: int) -> None:
        """Leave ``slot`` out for ``block_s`` now: a request pinned there got
        no first byte in ``stuck_s`` and was cancelled (router.forwarding.proxy)."""
        if 0 <= slot < len(self._slots):
            self._slots[slot].blocked_until = self._clock() + self._block_s

    def primer_for(self, slot: int, head: int | None, tokens: int) -> int | None:
        """The slot to copy into ``slot`` before its request, a prompt of
        ``tokens`` opening with the head digested ``head`` (None: no head)
        (router/forwarding/slot_priming.py): of the idle slots holding that
        head, the one with the shortest prompt (a copy moves its whole cache);
        None when ``slot`` holds the head already or no idle slot does.
        Called for every pinned request: ``slot`` holds its prompt from now on."""
        entry = self._slots[slot]
        held, entry.head, entry.tokens = entry.head, head, tokens
        if head is None or held == head:
            return None
        now = self._clock()
        donors = [
            i
            for i in self._mine
            if i != slot and self._slots[i].head == head and self._free(i, now)
        ]
        return min(donors, key=lambda i: self._slots[i].tokens) if donors else None

    def owner(self, slot: int) -> int | None:
        """The conversation ``slot`` last served (None: none yet)."""
        return self._slots[slot].owner

    def pinned(self) -> int:
        """Slots a conversation has been pinned to."""
        return sum(s.owner is not None for s in self._slots)

    def _free(self, slot: int, now: float) -> bool:
        """Not busy with this router's requests, nor blocked."""
        entry = self._slots[slot]
        return entry.busy == 0 and entry.blocked_until <= now

    def _take(self, slot: int, conversation: int) -> int:
        entry = self._slots[slot]
        self._tick += 1
        entry.owner, entry.used = conversation, self._tick
        entry.busy += 1
        entry.since = self._clock()
        return slot


class Slots:
    """Every replica's :class:`SlotTable` in one router (``clock``,
    ``stuck_s``, ``block_s`` and ``share``: each table's)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        stuck_s: float = STUCK_S,
        block_s: float = BLOCK_S,
        share: SlotShare = EVERY_SLOT,
    ) -> None:
        self._tables: dict[str, SlotTable] = {}
        self._clock = clock
        self._stuck_s = stuck_s
        self._block_s = block_s
        self._share = share

    @property
    def share(self) -> SlotShare:
        """The slots this router pins."""
        return self._share

    def pin(self, replica_id: str, slots: int, conversation: int) -> int | None:
        """A slot of ``replica_id`` (running ``slots`` slots) for ``conversation``."""
        if slots <= 0:
            return None
        table = self._tables.get(replica_id)
        if table is None or table.size != slots:
            if len(self._tables) >= MAX_TABLES:
                self._tables.clear()
            table = self._tables[replica_id] = SlotTable(
                slots, self._clock, self._stuck_s, self._block_s, self._share
            )
            if not self._share.of(slots):
                log.warning(
                    "replica %s runs %d slots: none is this router's (slot share %d of %d);"
                    " its requests go unpinned",
                    replica_id, slots, self._share.index, self._share.count,
                )  # fmt: skip
        return table.pin(conversation)

    def release(self, replica_id: str, slot: int, answered: bool) -> None:
        """A request pinned to ``slot`` of ``replica_id`` ended (SlotTable.release)."""
        table = self._tables.get(replica_id)
        if table is None:
            return
        waited = table.release(slot, answered)
        if waited:
            log.warning(
                "slot %d of replica %s: a request waited %.0f s there and ended unanswered;"
                " left out of this router's choices for %.0f s",
                slot, replica_id, waited, self._block_s,
            )  # fmt: skip

    def primer_for(self, replica_id: str, slot: int, head: int | None, tokens: int) -> int | None:
        """SlotTable.primer_for of the replica's table (None: no table)."""
        table = self._tables.get(replica_id)
        return table.primer_for(slot, head, tokens) if table is not None else None

    def block(self, replica_id: str, slot: int, waited_s: float) -> None:
        """SlotTable.block of the replica's table (a stream pinned there had
        no first byte in ``waited_s``), with a warning in the log."""
        table = self._tables.get(replica_id)
        if table is not None:
            table.block(slot)
            log.warning(
                "slot %d of replica %s: a stream pinned there had no first byte in %.0f s;"
                " left out of this router's choices for %.0f s",
                slot, replica_id, waited_s, self._block_s,
            )  # fmt: skip

    def pinned(self, replica_id: str) -> int:
        table = self._tables.get(replica_id)
        return table.pinned() if table is not None else 0

    def forget(self, replica_id: str) -> None:
        """The replica's engine is gone or restarted: its slots are empty."""
        self._tables.pop(replica_id, None)


# llama.cpp's id_slot for "any idle slot, the server's choice".
ANY_SLOT = -1


def with_slot(body: bytes, slot: int) -> bytes:
    """``body`` (a JSON object) asking llama.cpp for ``slot``: ``id_slot``
    appended last, so it is the value the engine reads (it keeps the last of
    repeated keys: a client's own ``id_slot`` never steers another's slot)."""
    return with_field(body, "id_slot", b"%d" % slot)


def with_field(body: bytes, name: str, value: bytes) -> bytes:
    """``body`` (a JSON object) with ``"name": value`` (``value``: JSON)
    appended last, the value engines read of a repeated key (llama.cpp's
    parser, and vLLM's and SGLang's: Python's json keeps the last)."""
    end = body.rstrip()
    if not end.endswith(b"}"):
        return body
    inner = end[:-1].rstrip()
    comma = b"" if inner.endswith(b"{") else b","
    return b'%s%s"%s":%s}' % (inner, comma, name.encode(), value)
