"""Where each live conversation of one model lives, as one router placed it.

The prefix rule hashes a new conversation to a replica (rendezvous on its
lead), and hashing a few dozen conversations onto a few replicas is uneven:
16 conversations on 4 replicas put 7 on one and 2 on another as often as
not, and each conversation brings all its turns there (bench_prefix W1: a
max/min load of 1.6 to 2.8). So the router counts, per replica, the
conversations it placed there that had a turn in the last ``LIVE_S``
seconds, and the rule sends a new one to the first replica in its
rendezvous order that has less than its share (router/affinity/policy.py,
``routing.balance_factor``).

A request that is never followed up (a one-off call, a health ping) looks
like a new conversation when it comes, and counting it for five minutes
would keep a real conversation off its replica: a conversation of a single
turn counts only for ``FIRST_TURN_S``, and again from its second turn on.

A conversation is its ``PromptKey.lead`` (or sticky key): the questions on
one document are one conversation, as they share its cache. Its home
follows where its turns are actually served (a failover or a balance move
takes it along). Counting is this router's own: routers that never talked
count alike only as far as they saw alike (docs/guides/routing.md).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# A conversation without a turn for this long no longer counts toward its
# replica's share: its user has likely gone, and its cache with it.
LIVE_S = 300.0
# A conversation of one turn counts this long (a chat's second turn comes
# within seconds of its answer; a one-off never does).
FIRST_TURN_S = 10.0
# Conversations remembered per model (the least recently active go first).
MAX_HOMES = 65_536


@dataclass(slots=True)
class _Home:
    replica_id: str
    at: float  # its last turn
    turns: int
    counted: bool  # in its replica's count now


class Homes:
    """The live conversations of one model, each with its replica."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        live_s: float = LIVE_S,
        max_homes: int = MAX_HOMES,
        first_turn_s: float = FIRST_TURN_S,
    ) -> None:
        self._clock = clock
        self._live_s = live_s
        self._first_turn_s = first_turn_s
        self._max = max_homes
        # lead -> its home, least recently active first.
        self._homes: OrderedDict[int, _Home] = OrderedDict()
        # Conversations of one turn still counted, by that turn's time.
        self._fresh: OrderedDict[int, float] = OrderedDict()
        self._counts: dict[str, int] = {}

    def home(self, conversation: int) -> str | None:
        """The replica ``conversation`` was last placed on, while it is live."""
        self._expire()
        entry = self._homes.get(conversation)
        return entry.replica_id if entry is not None else None

    def counts(self) -> Mapping[str, int]:
        """Counted conversations per replica (absent: none)."""
        self._expire()
        return self._counts

    def turn(self, conversation: int, replica_id: str) -> None:
        """A turn of ``conversation`` goes to ``replica_id``."""
        old = self._pop(conversation)
        turns = old.turns + 1 if old is not None else 1
        now = self._clock()
        self._homes[conversation] = _Home(replica_id, now, turns, counted=True)
        self._counts[replica_id] = self._counts.get(replica_id, 0) + 1
        if turns == 1:
            self._fresh[conversation] = now
        while len(self._homes) > self._max:
            gone, _ = next(iter(self._homes.items()))
            self._pop(gone)

    def served(self, conversation: int, replica_id: str) -> None:
        """``replica_id`` served the turn (a failover moves it): its home now."""
        entry = self._homes.get(conversation)
        if entry is None or entry.replica_id == replica_id:
            return
        if entry.counted:
            self._drop(entry.replica_id)
            self._counts[replica_id] = self._counts.get(replica_id, 0) + 1
        entry.replica_id = replica_id

    def forget(self, replica_id: str) -> None:
        """The replica is gone or restarted: its conversations are homeless."""
        for conversation in [c for c, h in self._homes.items() if h.replica_id == replica_id]:
            self._pop(conversation)
        self._counts.pop(replica_id, None)

    def _pop(self, conversation: int) -> _Home | None:
        entry = self._homes.pop(conversation, None)
        self._fresh.pop(conversation, None)
        if entry is not None and entry.counted:
            self._drop(entry.replica_id)
        return entry

    def _expire(self) -> None:
        now = self._clock()
        while self._homes:
            conversation, entry = next(iter(self._homes.items()))
            if entry.at >= now - self._live_s:
                break
            self._pop(conversation)
        while self._fresh:
            conversation, at = next(iter(self._fresh.items()))
            if at >= now - self._first_turn_s:
                break
            del self._fresh[conversation]
            entry = self._homes[conversation]
            entry.counted = False
            self._drop(entry.replica_id)

    def _drop(self, replica_id: str) -> None:
        left = self._counts.get(replica_id, 0) - 1
        if left > 0:
            self._counts[replica_id] = left
        else:
            self._counts.pop(replica_id, None)
