"""Choosing a node's peers (worker_agent/fetch/spread.py): a tree of bounded fan-out."""

from worker_agent.fetch.spread import choose_peers, plan_spread


def test_the_first_node_takes_the_origin_and_the_rest_form_a_tree() -> None:
    nodes = [f"n{i}" for i in range(1, 8)]
    plan = plan_spread([], nodes, fanout=2, alternatives=1)
    assert plan["n1"] == ()  # nobody holds it: the origin
    parents = {node: sources[0] for node, sources in plan.items() if sources}
    assert set(parents) == set(nodes) - {"n1"}  # the origin serves one node only
    children: dict[str, int] = {}
    for parent in parents.values():
        children[parent] = children.get(parent, 0) + 1
    assert max(children.values()) <= 2
    assert len(children) > 1  # not a star on the seed
    # Every chain reaches n1 (no cycles), within about log2(7) hops.
    for node in parents:
        hops, at = 0, node
        while at in parents:
            at, hops = parents[at], hops + 1
        assert at == "n1" and hops <= 3
    assert all(len(s) <= 2 and node not in s for node, s in plan.items())


def test_complete_holders_come_first_and_full_ones_give_way() -> None:
    fetching = {"a": ("seed",), "b": ("seed",), "c": ()}
    # seed has its two children: the next parent is another complete node.
    assert choose_peers("x", ["seed", "done"], fetching, fanout=2)[0] == "done"
    # With only the full seed complete, a fetching node nearest it serves.
    assert choose_peers("x", ["seed"], fetching, fanout=2, alternatives=0) == ("a",)
    assert choose_peers("x", ["seed"], fetching, fanout=3, alternatives=0) == ("seed",)


def test_a_node_never_fetches_from_itself_or_through_its_own_children() -> None:
    fetching = {"a": ("x",), "b": ("a",), "x": ("seed",)}
    peers = choose_peers("x", ["seed"], fetching, fanout=2, alternatives=5)
    assert peers == ("seed",)
    assert choose_peers("x", [], {"x": ()}) == ()
