"""The placement index chooses what the exhaustive scorer chooses.

``choose_node`` (every node filtered and scored, with reasons) is the
reference; the index must agree with it on every placement of random fleets
as claims come and go, nodes re-register with other GPUs, and some nodes are
left out (down or cordoned). Each fleet runs a handful of models, each placed
many times, so replicas of one model spread over the nodes holding fewest of
its ranks while other models bin-pack.
"""

import random

import pytest

from llmgw.types import (
    EngineProfile,
    FabricKind,
    GpuHealth,
    GpuInfo,
    ModelSpec,
    NodeFabric,
    NodeInventory,
    Placement,
)
from workflows.placement import choose_node
from workflows.placement_index import PlacementIndex

CLASSES = ["h100-80g", "a100-40g", ""]


def random_node(rng: random.Random, node_id: str) -> NodeInventory:
    gpus = rng.choice([0, 1, 2, 4, 8, 8])
    cls = rng.choice(CLASSES)
    return NodeInventory(
        node_id=node_id,
        hostname=node_id,
        address="127.0.0.1",
        cpu_count=8,
        memory_mib=1024,
        max_cpu_replicas=rng.choice([0, 1, 2, 4]),
        fabric=NodeFabric(kind=FabricKind.INFINIBAND, island=rng.choice(["", "ib-1", "ib-2"])),
        gpus=[
            GpuInfo(
                index=i,
                uuid=f"GPU-{node_id}-{i}",
                name="gpu",
                memory_mib=1024,
                # Mostly one class per node, now and then a mixed one.
                gpu_class=cls if rng.random() < 0.9 else rng.choice(CLASSES),
                health_flags=[GpuHealth.ECC_UNCORRECTED] if rng.random() < 0.1 else [],
            )
            for i in range(gpus)
        ],
    )


def random_model(rng: random.Random, name: str = "") -> ModelSpec:
    gpus = rng.choice([0, 0, 1, 1, 2, 4, 8])
    return ModelSpec(
        name=name or f"m{gpus}",
        source="/m",
        gpus=gpus,
        gpu_class=rng.choice([None, None, *CLASSES]) if gpus else None,
        spread=rng.random() < 0.3,
        priority=rng.randint(0, 3),
        profile=EngineProfile(nodes=rng.choice([1, 1, 1, 2, 3])),
    )


@pytest.mark.parametrize("seed", range(60))
def test_index_agrees_with_the_exhaustive_scorer(seed: int) -> None:
    rng = random.Random(seed)
    nodes = {f"n{i:02d}": random_node(rng, f"n{i:02d}") for i in range(rng.randint(1, 24))}
    catalog = [random_model(rng, f"model-{i}") for i in range(rng.randint(2, 6))]
    # One small model at least, so that some model surely runs several replicas.
    catalog.append(ModelSpec(name="small", source="/m", gpus=rng.choice([0, 1])))
    claims: dict[str, Placement] = {}
    index = PlacementIndex(nodes, claims)
    placed = again = 0
    for step in range(150):
        roll = rng.random()
        if roll < 0.15 and claims:
            key = rng.choice(sorted(claims))
            del claims[key]
            index.remove(key)
            continue
        if roll < 0.2:
            node_id = rng.choice(sorted(nodes))
            nodes[node_id] = random_node(rng, node_id)
            index.set_node(nodes[node_id])
            continue
        model = rng.choice(catalog)
        excluded = {n for n in nodes if rng.random() < 0.1}
        usable = {n: node for n, node in nodes.items() if n not in excluded}
        rid = f"r{step}"
        expected = choose_node(rid, model, usable, claims).placement
        assert index.choose(rid, model, excluded) == expected, (seed, step, model)
        if expected is not None:
            again += any(c.model == model.name for c in claims.values())
            claims[rid] = expected
            index.add(rid, expected)
            placed += 1
    assert placed > 0
    assert again > 0, "no model placed twice: the spreading rule untried"


def test_a_fresh_index_matches_one_kept_up_to_date() -> None:
    rng = random.Random(7)
    nodes = {f"n{i}": random_node(rng, f"n{i}") for i in range(12)}
    claims: dict[str, Placement] = {}
    kept = PlacementIndex(nodes)
    catalog = [random_model(rng, f"model-{i}") for i in range(4)]
    for i in range(60):
        model = rng.choice(catalog)
        placement = kept.choose(f"r{i}", model)
        if placement is not None:
            claims[f"r{i}"] = placement
            kept.add(f"r{i}", placement)
    fresh = PlacementIndex(nodes, claims)
    for i in range(40):
        model = rng.choice(catalog)
        assert fresh.choose(f"x{i}", model) == kept.choose(f"x{i}", model)
