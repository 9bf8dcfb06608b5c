"""Recovery decisions, without Temporal: catalog drift and ledger rebuild."""

from llmgw.types import (
    AutoscalePolicy,
    ModelSpec,
    NodeInventory,
    Placement,
    ShardPlacement,
    ShardReport,
)
from workflows.ledger import rebuild_from_report
from workflows.reconcile import Action, catalog_orders

A = ModelSpec(name="a", source="/a.gguf")
B = ModelSpec(name="b", source="/b.gguf")


def shard(rid: str, spec: ModelSpec, rank: int = 0, digest: str | None = None) -> ShardReport:
    return ShardReport(
        replica_id=rid, rank=rank, pid=1, endpoint="http://127.0.0.1:1", model=spec.name,
        catalog_digest=spec.digest() if digest is None else digest, gpu_indices=[rank],
    )  # fmt: skip


def test_digest_follows_every_field() -> None:
    assert A.digest() == ModelSpec.model_validate_json(A.model_dump_json()).digest()
    assert A.digest() != A.model_copy(update={"context_length": 1024}).digest()


def test_deployment_of_a_removed_model_is_removed_and_a_changed_one_updated() -> None:
    changed = B.model_copy(update={"context_length": 1024})
    orders = catalog_orders({"b": changed}, {"a": A.digest(), "b": B.digest()}, [])
    assert [(o.action, o.target) for o in orders] == [
        (Action.REMOVE_DEPLOYMENT, "a"),
        (Action.UPDATE_DEPLOYMENT, "b"),
    ]
    assert orders[0].reason == "model a left the catalog"


def test_replicas_without_deployment_stop_when_their_entry_is_gone_or_changed() -> None:
    running = [
        shard("a-1", A),
        shard("b-1", B),
        shard("b-2", B, rank=1),  # ranks stop with their leader
        shard("old-1", A, digest=""),  # started before digests: left alone
    ]
    changed = B.model_copy(update={"engine_args": ["--foo"]})
    orders = catalog_orders({"b": changed}, {}, running)
    assert [(o.action, o.target, o.reason) for o in orders] == [
        (Action.STOP_REPLICA, "a-1", "model a left the catalog"),
        (Action.STOP_REPLICA, "b-1", "model b changed in the catalog"),
    ]


def test_in_sync_means_nothing_to_do() -> None:
    assert catalog_orders({"a": A}, {"a": A.digest()}, [shard("a-1", A), shard("x", A)]) == []


def test_a_changed_autoscale_policy_is_pushed_without_a_roll_or_a_count() -> None:
    policy = AutoscalePolicy(min_replicas=0, max_replicas=3)
    elastic = A.model_copy(update={"autoscale": policy})
    # Bounds are not how an engine runs: no roll, only the policy.
    assert elastic.digest() == A.digest()
    orders = catalog_orders({"a": elastic}, {"a": A.digest()}, [], {"a": None})
    assert [(o.action, o.target, o.reason) for o in orders] == [
        (Action.SET_AUTOSCALE, "a", "model a: autoscale 0..3 in the catalog")
    ]
    # In sync, whatever count the autoscaler chose: nothing to do.
    assert catalog_orders({"a": elastic}, {"a": A.digest()}, [], {"a": policy}) == []
    # Turned off in the catalog: the deployment keeps its count, fixed.
    orders = catalog_orders({"a": A}, {"a": A.digest()}, [], {"a": policy})
    assert [(o.action, o.reason) for o in orders] == [
        (Action.SET_AUTOSCALE, "model a: autoscale off in the catalog")
    ]


def test_ledger_rebuilt_from_what_nodes_report() -> None:
    allocations: dict[str, Placement] = {
        "known": Placement(replica_id="known", model="a", node_id="n1", gpu_indices=[0])
    }
    n1 = NodeInventory(
        node_id="n1", hostname="n1", address="10.0.0.1", cpu_count=8, memory_mib=1,
        running=[shard("known", A), shard("lost", A), shard("wide", B)],
    )  # fmt: skip
    n2 = NodeInventory(
        node_id="n2", hostname="n2", address="10.0.0.2", cpu_count=8, memory_mib=1,
        running=[shard("wide", B, rank=1), shard("early", B, rank=1)],
    )  # fmt: skip
    assert rebuild_from_report(allocations, n1) == ["lost/0", "wide/0"]
    assert rebuild_from_report(allocations, n2) == ["wide/1"]
    assert allocations["lost"].node_id == "n1" and allocations["lost"].gpu_indices == [0]
    assert allocations["wide"].workers == [ShardPlacement(rank=1, node_id="n2", gpu_indices=[1])]
    assert "early" not in allocations  # its leader has not reported yet
    assert rebuild_from_report(allocations, n1) == []  # idempotent


def test_a_new_field_at_its_default_keeps_the_digest() -> None:
    class NextRelease(ModelSpec):
        some_new_knob: int = 0

    assert NextRelease(name="a", source="/a.gguf").digest() == A.digest()
    assert A.digest() != A.model_copy(update={"priority": 1}).digest()
