"""How CPU engines share a node's cores and memory (pure rules)."""

from worker_agent.cpu_share import (
    KV_MIN_BYTES,
    MIB,
    NOBIND,
    choose_binding,
    cores_per_engine,
    format_cpu_list,
    kv_cache_bytes,
    parse_cpu_list,
)


def test_cpu_lists_round_trip() -> None:
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert parse_cpu_list("0-2,5|7-8") == {0, 1, 2, 5, 7, 8}
    assert parse_cpu_list(NOBIND) == set()
    assert parse_cpu_list("") == set()


def test_two_engines_get_disjoint_cores() -> None:
    first = choose_binding(range(8), taken=set(), per_rank=4)
    second = choose_binding(range(8), taken=parse_cpu_list(first), per_rank=4)
    assert (first, second) == ("0-3", "4-7")


def test_tensor_parallel_ranks_get_one_list_each() -> None:
    assert choose_binding(range(8), taken={0}, per_rank=2, ranks=3) == "1-2|3-4|5-6"


def test_no_free_cores_leaves_threads_unbound_rather_than_sharing_a_pinned_core() -> None:
    assert choose_binding([0, 1], taken={0, 1}, per_rank=1) == NOBIND
    assert choose_binding([0, 1], taken={1}, per_rank=2) == NOBIND


def test_cores_per_engine_is_a_share_unless_configured() -> None:
    assert cores_per_engine(16, max_cpu_replicas=4) == 4
    assert cores_per_engine(2, max_cpu_replicas=4) == 1
    assert cores_per_engine(16, max_cpu_replicas=4, threads=3) == 3


def test_kv_cache_is_a_share_of_memory_unless_configured() -> None:
    assert kv_cache_bytes(16384, max_cpu_replicas=4) == 1024 * MIB
    assert kv_cache_bytes(16384, max_cpu_replicas=4, configured_mib=64) == 64 * MIB
    assert kv_cache_bytes(100, max_cpu_replicas=4) == KV_MIN_BYTES
