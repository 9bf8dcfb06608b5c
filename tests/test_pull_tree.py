"""A pull's tree (workflows/model_pull.py pull_tree): the origin for the first
node, then parents before grandparents, no node asking itself or a child."""

from workflows.model_pull import PULL_FANOUT, PULL_PEERS, pull_tree


def test_each_node_asks_its_ancestors_nearest_first() -> None:
    nodes = [f"n{i}" for i in range(8)]
    tree = pull_tree(nodes)
    assert tree["n0"] == []
    assert tree["n1"] == tree["n2"] == ["n0"]
    assert tree["n3"] == ["n1", "n0"] and tree["n6"] == ["n2", "n0"]
    assert tree["n7"] == ["n3", "n1", "n0"][:PULL_PEERS]
    for i, node in enumerate(nodes):
        assert all(nodes.index(p) < i for p in tree[node])  # never a cycle
    children = [tree[n][0] for n in nodes[1:]]
    assert max(children.count(n) for n in nodes) <= PULL_FANOUT
