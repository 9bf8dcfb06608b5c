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
never talked tend to agree), else the least recently used idle one. When
every slot is busy with this router's requests the request goes unpinned
and the engine queues it for whichever slot frees first.

A router knows only its own requests: two routers may pin different
conversations to one slot. Each such clash costs one history, as the
engine's own choice would.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.affinity.policy import rendezvous

# Replicas' slot tables kept per router (cleared past this: replicas come and go).
MAX_TABLES = 10_000


@dataclass(slots=True)
class _Slot:
    owner: int | None = None  # the conversation (PromptKey.lead) it last served
    used: int = -1  # when it was last pinned (a tick; -1: never)
    busy: int = 0  # this router's requests on it now


class SlotTable:
    """One replica's engine slots as this router has pinned them."""

    def __init__(self, slots: int) -> None:
        self._slots = [_Slot() for _ in range(slots)]
        self._tick = 0
        self._names = [str(i) for i in range(slots)]

    @property
    def size(self) -> int:
        return len(self._slots)

    def pin(self, conversation: int) -> int | None:
        """The slot for a request of ``conversation`` (counted busy until
        :meth:`release`), or None: every slot is busy with this router's requests.

        A slot is the conversation's when its last request was (questions on
        one document sent at once fill several): the idle one used last.
        """
        idle = [i for i, s in enumerate(self._slots) if s.busy == 0]
        if not idle:
            return None
        own = [i for i in idle if self._slots[i].owner == conversation]
        if own:
            return self._take(max(own, key=lambda i: self._slots[i].used), conversation)
        free = [self._names[i] for i in idle if self._slots[i].owner is None]
        if free:
            return self._take(int(rendezvous(conversation, free)[0]), conversation)
        return self._take(min(idle, key=lambda i: self._slots[i].used), conversation)

    def release(self, slot: int) -> None:
        """A request pinned to ``slot`` ended."""
        if 0 <= slot < len(self._slots) and self._slots[slot].busy > 0:
            self._slots[slot].busy -= 1

    def owner(self, slot: int) -> int | None:
        """The conversation ``slot`` last served (None: none yet)."""
        return self._slots[slot].owner

    def pinned(self) -> int:
        """Slots a conversation has been pinned to."""
        return sum(s.owner is not None for s in self._slots)

    def _take(self, slot: int, conversation: int) -> int:
        entry = self._slots[slot]
        self._tick += 1
        entry.owner, entry.used = conversation, self._tick
        entry.busy += 1
        return slot


class Slots:
    """Every replica's :class:`SlotTable` in one router."""

    def __init__(self) -> None:
        self._tables: dict[str, SlotTable] = {}

    def pin(self, replica_id: str, slots: int, conversation: int) -> int | None:
        """A slot of ``replica_id`` (running ``slots`` slots) for ``conversation``."""
        if slots <= 0:
            return None
        table = self._tables.get(replica_id)
        if table is None or table.size != slots:
            if len(self._tables) >= MAX_TABLES:
                self._tables.clear()
            table = self._tables[replica_id] = SlotTable(slots)
        return table.pin(conversation)

    def release(self, replica_id: str, slot: int) -> None:
        table = self._tables.get(replica_id)
        if table is not None:
            table.release(slot)

    def pinned(self, replica_id: str) -> int:
        table = self._tables.get(replica_id)
        return table.pinned() if table is not None else 0

    def forget(self, replica_id: str) -> None:
        """The replica's engine is gone or restarted: its slots are empty."""
        self._tables.pop(replica_id, None)


def with_slot(body: bytes, slot: int) -> bytes:
    """``body`` (a JSON object) asking llama.cpp for ``slot``: ``id_slot``
    appended last, so it is the value the engine reads (it keeps the last of
    repeated keys: a client's own ``id_slot`` never steers another's slot)."""
    end = body.rstrip()
    if not end.endswith(b"}"):
        return body
    inner = end[:-1].rstrip()
    comma = b"" if inner.endswith(b"{") else b","
    return b'%s%s"id_slot":%d}' % (inner, comma, slot)
