"""What each replica of one model is believed to hold in its prompt cache.

Per replica, an LRU of chunk digests bounded by an estimate of its cache's
capacity in tokens. Chained digests make each entry stand for a whole
prefix, so shared prefixes (one system prompt, many conversations) are held
once, as in the engine. A served prompt touches its chunks last to first,
so a chain's leading chunks are the most recent and eviction takes chains
from their tails, as an engine's prefix cache does.

Self-correction (:meth:`PrefixIndex.correct`): when the engine reports fewer
cached tokens than predicted, the replica no longer holds this chain past
what it reported: those entries are dropped, and its capacity estimate
shrinks by a quarter (never below an eighth of the nominal), evicting the
oldest chains to fit, since the cache evidently holds less than assumed.
Each confirmed prediction (the engine reported at least what was predicted)
gives back the confirmed tokens to the estimate, up to the nominal: the
estimate recovers as predictions come true.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from router.affinity.chunks import PromptKey

# A capacity estimate never shrinks below this share of the nominal.
MIN_CAPACITY_SHARE = 8
# A miss keeps this share of the capacity estimate (numerator / 4).
SHRINK_QUARTERS = 3


@dataclass
class _Held:
    """One replica's believed cache contents."""

    capacity: int
    entries: OrderedDict[int, int] = field(default_factory=OrderedDict)  # digest -> tokens
    tokens: int = 0

    def evict_to(self, capacity: int) -> None:
        while self.tokens > capacity and self.entries:
            _, tokens = self.entries.popitem(last=False)
            self.tokens -= tokens


class PrefixIndex:
    """The believed prompt caches of one model's replicas."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = max(1, capacity_tokens)
        self._held: dict[str, _Held] = {}

    def set_capacity(self, capacity_tokens: int) -> None:
        """A new nominal capacity (the catalog changed): estimates restart from it."""
        self.capacity_tokens = max(1, capacity_tokens)
        for held in self._held.values():
            held.capacity = self.capacity_tokens
            held.evict_to(held.capacity)

    def match(self, replica_id: str, key: PromptKey) -> int:
        """Predicted cached tokens: those of the longest leading run of
        ``key``'s chunks the replica holds."""
        held = self._held.get(replica_id)
        if held is None:
            return 0
        total = 0
        for chunk in key.chunks:
            if chunk.digest not in held.entries:
                break
            total += chunk.tokens
        return total

    def record(self, replica_id: str, key: PromptKey) -> None:
        """The replica served this prompt: it holds every chunk now (the most
        recent, leading chunks last touched), oldest chains evicted past capacity."""
        held = self._held.get(replica_id)
        if held is None:
            held = self._held[replica_id] = _Held(self.capacity_tokens)
        for chunk in reversed(key.chunks):
            if chunk.digest in held.entries:
                held.entries.move_to_end(chunk.digest)
            else:
                held.entries[chunk.digest] = chunk.tokens
                held.tokens += chunk.tokens
        held.evict_to(held.capacity)

    def correct(self, replica_id: str, key: PromptKey, predicted: int, reported: int) -> None:
        """Reconcile with the engine's report of ``reported`` cached tokens
        (estimated units) where ``predicted`` were expected.

        Fewer: drop this chain's entries from the first chunk that ends past
        ``reported``, and shrink the capacity estimate by a quarter (floor:
        an eighth of the nominal), evicting the oldest to fit. At least as
        many: the estimate regains ``predicted`` tokens, up to the nominal.
        """
        held = self._held.get(replica_id)
        if held is None or predicted <= 0:
            return
        if reported >= predicted:
            held.capacity = min(self.capacity_tokens, held.capacity + predicted)
            return
        end = 0
        for chunk in key.chunks:
            end += chunk.tokens
            if end > reported:
                tokens = held.entries.pop(chunk.digest, None)
                if tokens is not None:
                    held.tokens -= tokens
        floor = max(1, self.capacity_tokens // MIN_CAPACITY_SHARE)
        held.capacity = max(floor, held.capacity * SHRINK_QUARTERS // 4)
        held.evict_to(held.capacity)

    def forget(self, replica_id: str) -> None:
        """The replica's cache is gone (drained, stopped, restarted)."""
        self._held.pop(replica_id, None)

    def held_tokens(self, replica_id: str) -> int:
        """Tokens the replica is believed to hold."""
        held = self._held.get(replica_id)
        return held.tokens if held is not None else 0

    def capacity(self, replica_id: str) -> int:
        """The replica's current capacity estimate."""
        held = self._held.get(replica_id)
        return held.capacity if held is not None else self.capacity_tokens

    def replicas(self) -> set[str]:
        """Replicas with an entry (forgotten ones excluded)."""
        return set(self._held)
