"""Which peers a node fetches an artifact from: a tree, not a star on one seed.

Pure (no I/O): the control plane knows which nodes hold an artifact complete
and which are fetching it (and from whom), and asks for the sources of a node
about to fetch. A node fetching serves what it has already received
(peer_server.py), so it can be a parent too; each node serves at most
``fanout`` children, so the origin's one copy spreads in about log_k(n)
rounds of the slowest link instead of n copies out of one node.

The result is an ordered list of node ids for ``ArtifactSpec.peers`` (the
origin always comes after them): the chosen parent first, then a few other
holders as alternatives for when it fails.
"""

from collections.abc import Iterable, Mapping, Sequence


def _root_of(node: str, fetching: Mapping[str, Sequence[str]], seen: set[str]) -> list[str]:
    """The chain of first sources from ``node`` up to a complete node or the origin."""
    chain = [node]
    while True:
        sources = fetching.get(chain[-1], ())
        if not sources or sources[0] in seen or sources[0] in chain:
            return chain
        chain.append(sources[0])


def choose_peers(
    node: str,
    complete: Iterable[str],
    fetching: Mapping[str, Sequence[str]],
    *,
    fanout: int = 2,
    alternatives: int = 2,
) -> tuple[str, ...]:
    """The peers ``node`` should try, in order, before the origin.

    ``complete``: nodes holding the artifact whole; ``fetching``: nodes fetching
    it now, each with the sources it was given (its first is its parent; an
    empty one fetches from the origin). The parent is the holder with a free
    slot (fewer than ``fanout`` children) nearest the origin's copy: complete
    nodes first, then fetching nodes by depth, then fewest children, then
    name. A node is never its own source, nor fetches from a node that fetches
    through it. Then up to ``alternatives`` other holders, in the same order
    regardless of slots. Empty: fetch from the origin.
    """
    done = set(complete) - {node}
    children: dict[str, int] = {}
    for other, sources in fetching.items():
        if other != node and sources:
            children[sources[0]] = children.get(sources[0], 0) + 1
    candidates: list[tuple[int, int, str]] = []
    for holder in sorted(done | set(fetching)):
        if holder == node:
            continue
        if holder in done:
            depth = 0
        else:
            chain = _root_of(holder, fetching, done)
            if node in chain:
                continue  # it fetches through us: a cycle
            depth = len(chain)
        candidates.append((depth, children.get(holder, 0), holder))
    candidates.sort()
    free = [c for c in candidates if c[1] < fanout]
    if not free:
        return ()
    parent = free[0][2]
    rest = [c[2] for c in candidates if c[2] != parent]
    return (parent, *rest[:alternatives])


def plan_spread(
    complete: Iterable[str],
    starting: Sequence[str],
    *,
    fanout: int = 2,
    alternatives: int = 2,
) -> dict[str, tuple[str, ...]]:
    """Sources for each of ``starting`` (nodes starting a fetch at once, in that
    order), each seeing the ones planned before it as fetching."""
    holders = list(complete)
    plan: dict[str, tuple[str, ...]] = {}
    for node in starting:
        plan[node] = choose_peers(node, holders, plan, fanout=fanout, alternatives=alternatives)
    return plan
