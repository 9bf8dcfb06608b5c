"""Placement on a large fleet: nodes indexed by free capacity.

``choose_node`` filters and scores every node for every replica and says why
each was turned down: on 500 nodes that is milliseconds a placement, most of
it spent on nodes that cannot fit. The index keeps, per node, how many ranks
it holds and how many healthy GPUs of each class are free, and files the node
in buckets by (class, free GPUs) and, inside a bucket, by ranks held. A
placement looks only at the buckets with room enough, and (single-node) only
at the busiest level of each (the idlest, to spread). Nodes already holding
ranks of the same model rank last (``choose_node``'s first criterion): the
index counts them per model, and looks at them, few as they are, only when
every other node is out.

It makes the choice ``choose_node`` makes (tests/control/test_placement_index.py
compares them on random fleets); it computes no reasons: ``choose_node`` gives
them when nothing fits, or when asked (``llmgw explain``). The index is derived
state, rebuilt from the ledger whenever in doubt, never stored.
"""

from collections import Counter
from collections.abc import Mapping, Set

from llmgw.types import ModelSpec, NodeInventory, Placement
from workflows.placement import build_placement, missing_capability, pick_island, replicas_spread

# Nodes by ranks held.
Levels = dict[int, set[str]]


class _Held:
    """What the ledger holds on one node."""

    __slots__ = ("cpu", "ranks", "taken")

    def __init__(self) -> None:
        self.ranks = 0
        self.cpu = 0  # ranks holding no GPU: CPU replica slots in use
        self.taken: Counter[int] = Counter()


class PlacementIndex:
    """Nodes by free capacity, kept up to date as claims come and go."""

    def __init__(
        self,
        nodes: Mapping[str, NodeInventory] | None = None,
        claims: Mapping[str, Placement] | None = None,
    ) -> None:
        self._nodes: dict[str, NodeInventory] = {}
        self._held: dict[str, _Held] = {}
        # Per claim key: its model, and the (node, GPU indices) of each of its ranks.
        self._claims: dict[str, tuple[str, list[tuple[str, list[int]]]]] = {}
        # Per model: its claims' ranks per node (only nodes holding some).
        self._models: dict[str, Counter[str]] = {}
        # (GPU class, None for any class; free healthy GPUs) -> nodes by ranks.
        self._gpu: dict[tuple[str | None, int], Levels] = {}
        self._cpu: Levels = {}  # nodes with a CPU replica slot free
        # Where each node is filed: the levels, and its ranks there.
        self._filed: dict[str, tuple[list[Levels], int]] = {}
        for held in (claims or {}).items():
            self.add(*held)
        for node in (nodes or {}).values():
            self.set_node(node)

    def set_node(self, node: NodeInventory) -> None:
        """A node (re)registered: its inventory replaces the one known."""
        self._nodes[node.node_id] = node
        self._refile(node.node_id)

    def add(self, key: str, placement: Placement) -> None:
        """A claim (an allocation, or room reserved under ``key``) holds its ranks."""
        self.remove(key)
        ranks = [(s.node_id, list(s.gpu_indices)) for s in placement.shards()]
        self._claims[key] = (placement.model, ranks)
        self._models.setdefault(placement.model, Counter()).update(n for n, _ in ranks)
        for node_id, gpus in ranks:
            held = self._held.setdefault(node_id, _Held())
            held.ranks += 1
            held.cpu += not gpus
            held.taken.update(gpus)
        for node_id in {n for n, _ in ranks}:
            self._refile(node_id)

    def remove(self, key: str) -> None:
        """A claim is given back (no-op when unknown)."""
        claim = self._claims.pop(key, None)
        if claim is None:
            return
        model, ranks = claim
        same = self._models[model]
        same.subtract(n for n, _ in ranks)
        same += Counter()  # drops nodes holding none of the model any more
        if not same:
            del self._models[model]
        for node_id, gpus in ranks:
            held = self._held[node_id]
            held.ranks -= 1
            held.cpu -= not gpus
            held.taken.subtract(gpus)
            held.taken += Counter()  # drops indices no longer taken
        for node_id in {n for n, _ in ranks}:
            self._refile(node_id)

    def choose(
        self, replica_id: str, model: ModelSpec, excluded: Set[str] = frozenset()
    ) -> Placement | None:
        """Where ``choose_node`` would place ``replica_id`` (not yet placed)
        on the indexed nodes less ``excluded``, or None when nothing fits."""
        if model.gpus == 0:
            buckets = [self._cpu]
        else:
            buckets = [
                levels
                for (cls, free), levels in self._gpu.items()
                if cls == model.gpu_class and free >= model.gpus
            ]
        same = self._models.get(model.name, Counter[str]())
        if not replicas_spread(bool(same)):
            same = Counter()
        if model.profile.nodes == 1:
            best = self._best(buckets, model.spread, {*excluded, *same} if same else excluded)
            if best is None and same:
                best = self._best_holding(buckets, model.spread, excluded, same)
            chosen = [] if best is None else [self._nodes[best]]
        else:
            # A node is in one bucket per class: no duplicates to remove.
            passed = sorted(
                (self._nodes[n] for levels in buckets for ns in levels.values() for n in ns),
                key=lambda n: n.node_id,
            )
            passed = [
                n
                for n in passed
                if n.node_id not in excluded and missing_capability(n, model) is None
            ]
            chosen, _ = pick_island(model, passed, self._ranks, lambda n: same[n])
        if not chosen:
            return None
        return build_placement(
            replica_id, model, [(n.node_id, self._free(n, model.gpu_class)) for n in chosen]
        )

    def _best(self, buckets: list[Levels], spread: bool, excluded: Set[str]) -> str | None:
        # The score is (ranks, node id), ranks negated to spread: per bucket,
        # the first level (busiest or idlest) with a usable node holds its
        # best, the highest node id there.
        best: tuple[int, str] | None = None
        for levels in buckets:
            for ranks in sorted(levels, reverse=not spread):
                usable = levels[ranks] - excluded if excluded else levels[ranks]
                if usable:
                    score = (-ranks if spread else ranks, max(usable))
                    best = score if best is None else max(best, score)
                    break
        return None if best is None else best[1]

    def _best_holding(
        self, buckets: list[Levels], spread: bool, excluded: Set[str], same: Counter[str]
    ) -> str | None:
        # Every usable node holds ranks of the model: they are few (its
        # replicas' nodes), so each is scored as choose_node scores it.
        best: tuple[int, int, str] | None = None
        for node_id, held in same.items():
            ranks = self._ranks(node_id)
            if node_id in excluded or not any(node_id in b.get(ranks, ()) for b in buckets):
                continue
            score = (-held, -ranks if spread else ranks, node_id)
            best = score if best is None else max(best, score)
        return None if best is None else best[2]

    def _ranks(self, node_id: str) -> int:
        held = self._held.get(node_id)
        return 0 if held is None else held.ranks

    def _free(self, node: NodeInventory, gpu_class: str | None) -> list[int]:
        held = self._held.get(node.node_id)
        taken = held.taken if held is not None else Counter[int]()
        return [
            g.index
            for g in node.gpus
            if not g.health_flags and not taken[g.index] and gpu_class in (None, g.gpu_class)
        ]

    def _refile(self, node_id: str) -> None:
        filed, ranks = self._filed.pop(node_id, ([], 0))
        for levels in filed:
            levels[ranks].discard(node_id)
            if not levels[ranks]:
                del levels[ranks]
        node = self._nodes.get(node_id)
        if node is None:
            return
        held = self._held.get(node_id) or _Held()
        free: Counter[str | None] = Counter()
        for g in node.gpus:
            if not g.health_flags and not held.taken[g.index]:
                free[None] += 1
                free[g.gpu_class] += 1
        filed = [self._gpu.setdefault(bucket, {}) for bucket in free.items()]
        if held.cpu < node.max_cpu_replicas:
            filed.append(self._cpu)
        for levels in filed:
            levels.setdefault(held.ranks, set()).add(node_id)
        self._filed[node_id] = (filed, held.ranks)
