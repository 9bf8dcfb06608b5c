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

# A conversation without a turn for this long no longer counts toward its
# replica's share: its user has likely gone, and its cache with it.
LIVE_S = 300.0
# Conversations remembered per model (the least recently active go first).
MAX_HOMES = 65_536


class Homes:
    """The live conversations of one model, each with its replica."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        live_s: float = LIVE_S,
        max_homes: int = MAX_HOMES,
    ) -> None:
        self._clock = clock
        self._live_s = live_s
        self._max = max_homes
        # lead -> (replica id, last turn), least recently active first.
        self._homes: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._counts: dict[str, int] = {}

    def home(self, conversation: int) -> str | None:
        """The replica ``conversation`` was last placed on, while it is live."""
        self._expire()
        entry = self._homes.get(conversation)
        return entry[0] if entry is not None else None

    def counts(self) -> Mapping[str, int]:
        """Live conversations per replica (absent: none)."""
        self._expire()
        return self._counts

    def place(self, conversation: int, replica_id: str) -> None:
        """A turn of ``conversation`` goes to (or was served by) ``replica_id``."""
        old = self._homes.pop(conversation, None)
        if old is not None:
            self._drop(old[0])
        self._homes[conversation] = (replica_id, self._clock())
        self._counts[replica_id] = self._counts.get(replica_id, 0) + 1
        while len(self._homes) > self._max:
            _, (gone, _) = self._homes.popitem(last=False)
            self._drop(gone)

    def forget(self, replica_id: str) -> None:
        """The replica is gone or restarted: its conversations are homeless."""
        for conversation in [c for c, (r, _) in self._homes.items() if r == replica_id]:
            del self._homes[conversation]
        self._counts.pop(replica_id, None)

    def _expire(self) -> None:
        horizon = self._clock() - self._live_s
        while self._homes:
            conversation, (replica_id, at) = next(iter(self._homes.items()))
            if at >= horizon:
                return
            del self._homes[conversation]
            self._drop(replica_id)

    def _drop(self, replica_id: str) -> None:
        left = self._counts.get(replica_id, 0) - 1
        if left > 0:
            self._counts[replica_id] = left
        else:
            self._counts.pop(replica_id, None)
