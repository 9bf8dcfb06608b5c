"""The catalog file: what it accepts, and errors that name the field; entries
checked against the rest of the catalog and written under its lock."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from llmgw.catalog import CatalogModel, parse_catalog, problems_with
from llmgw.errors import ConfigError
from llmgw.store import Store
from llmgw.store.catalog_store import apply_entries, list_entries, scaled_entry
from llmgw.types import AdapterSpec, EngineKind

GOOD = """
models:
  - name: tiny
    engine: llama.cpp
    source: /srv/tiny.gguf
    replicas: 2
  - name: big
    engine: vllm
    source: /srv/big
    gpus: 8
    profile: {tp: 8, nodes: 2, launch_mode: ray}
"""


def test_a_good_file() -> None:
    tiny, big = parse_catalog(GOOD)
    assert (tiny.name, tiny.replicas, tiny.engine) == ("tiny", 2, EngineKind.LLAMA_CPP)
    assert big.spec().profile.nodes == 2 and big.spec().profile.launch_mode == "ray"
    assert "replicas" not in big.spec().model_dump()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("replicas: 2", "replicass: 2"), "models[0].replicass: Extra inputs"),
        (GOOD.replace("tp: 8", "tp: 0"), "models[1].profile.tp: Input should be greater"),
        (GOOD.replace("engine: vllm", "engine: trt"), "models[1].engine: Input should be"),
        (GOOD.replace("name: big", "name: tiny"), "duplicate names tiny"),
        ("models: [", "not valid YAML"),
        ("{}", "models: Field required"),
        (
            GOOD.replace("replicas: 2", "autoscale: {min_replicas: 3, max_replicas: 2}"),
            "models[0].autoscale.max_replicas: Value error, must not be below min_replicas (3)",
        ),
        (
            GOOD.replace("replicas: 2", "autoscale: {target_inflight: 0}"),
            "models[0].autoscale.target_inflight: Input should be greater than 0",
        ),
        (
            GOOD.replace("replicas: 2", "autoscale: {max_replica: 2}"),
            "models[0].autoscale.max_replica: Extra inputs",
        ),
        (GOOD.replace("replicas: 2", "queue: {max_wait_s: -1}"), "models[0].queue.max_wait_s:"),
    ],
)
def test_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_catalog(text)
    assert message in str(err.value)


def test_autoscale_and_queue_are_read_and_stored_with_the_spec(store_url: str) -> None:
    text = GOOD.replace(
        "replicas: 2",
        "autoscale: {min_replicas: 0, max_replicas: 4, idle_timeout_s: 30}\n"
        "    queue: {max_waiting: 8}",
    )
    tiny, _ = parse_catalog(text)
    assert tiny.autoscale is not None and tiny.autoscale.idle_timeout_s == 30
    store = Store(store_url)
    store.migrate()
    assert apply_entries(store, [tiny]) == []
    # The router reads the spec from the store: it sees the bounds and the queue.
    stored = store.get_model("tiny")
    assert stored is not None and stored.autoscale == tiny.autoscale
    assert stored.queue.max_waiting == 8


def test_scaling_an_entry_sets_bounds_or_a_fixed_count() -> None:
    (tiny, _) = parse_catalog(GOOD)
    bounded = scaled_entry(tiny, min_replicas=1, max_replicas=3)
    assert bounded.autoscale is not None
    assert (bounded.autoscale.min_replicas, bounded.autoscale.max_replicas) == (1, 3)
    assert bounded.replicas == 2
    assert scaled_entry(bounded, max_replicas=5).autoscale.min_replicas == 1  # type: ignore[union-attr]
    fixed = scaled_entry(bounded, replicas=4)
    assert (fixed.autoscale, fixed.replicas) == (None, 4)
    with pytest.raises(ConfigError, match=r"autoscale.max_replicas: .*below min_replicas \(4\)"):
        scaled_entry(tiny, min_replicas=4, max_replicas=2)


def test_adapter_names_share_the_model_namespace() -> None:
    text = """
models:
  - name: base
    source: /m.gguf
    adapters: [{name: sql, source: /a/sql.gguf}, {name: base, source: /a/x.gguf}]
  - name: other
    source: /o.gguf
    adapters: [{name: sql, source: /a/sql2.gguf}]
"""
    with pytest.raises(ConfigError) as err:
        parse_catalog(text)
    assert "models[0].adapters[1].name: 'base' is also a model's name" in str(err.value)
    assert "models[1].adapters[0].name: 'sql' is already an adapter of base" in str(err.value)


def test_runtime_lora_is_vllm_only() -> None:
    text = "models: [{name: m, source: /m.gguf, profile: {runtime_lora: true}}]"
    with pytest.raises(ConfigError, match=r"models\[0\].profile.runtime_lora: only vLLM"):
        parse_catalog(text)


def _entry(name: str, *adapters: str) -> CatalogModel:
    return CatalogModel(
        name=name,
        source=f"/srv/{name}",
        adapters=[AdapterSpec(name=a, source=f"/srv/{a}") for a in adapters],
    )


def test_problems_with_names_what_the_new_entries_break() -> None:
    existing = [_entry("base", "sql"), _entry("old", "dup"), _entry("dup")]  # old was broken
    assert problems_with([_entry("sql")], existing) == [
        "model base: adapters[0].name: 'sql' is also a model's name"
    ]
    assert problems_with([_entry("new", "a", "sql")], existing, lambda _: "") == [
        "adapters[1].name: 'sql' is already an adapter of base"
    ]
    # Replacing an entry by itself, or fixing nothing that was broken, is no problem of theirs.
    assert problems_with([_entry("base", "sql", "more")], existing) == []
    assert problems_with([_entry("new")], existing) == []


def test_concurrent_writers_cannot_both_add_a_clashing_adapter(store_url: str) -> None:
    """Two processes (two stores on one database) each add a model whose adapter
    has the same name: the check and the write are one step, so one of them wins."""
    stores = [Store(store_url) for _ in range(2)]
    stores[0].migrate()
    for round_ in range(5):
        entries = [_entry(f"m{round_}-{i}", f"shared{round_}") for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(apply_entries, stores, [[e] for e in entries]))
        assert sorted(bool(r) for r in results) == [False, True], results
        assert any(f"'shared{round_}' is already an adapter of" in p for r in results for p in r)
    assert len(list_entries(stores[0])) == 5
    for store in stores:
        store.close()
