"""Replica counts are bounded (LLMGW_MAX_REPLICAS_PER_MODEL): the catalog
file, the admin API's catalog and scale calls, and ``llmgw scale`` refuse a
count past it, naming the field and the limit."""

from pathlib import Path
from typing import cast

import pytest
from temporalio.client import Client

from llmgw.catalog import parse_catalog
from llmgw.errors import ConfigError
from llmgw.settings import RouterSettings
from llmgw.store import Store
from llmgw.store.catalog_store import get_entry, scale_model
from tests.gateway_util import ADMIN_KEY, auth, gateway, ready, spec

LIMIT = 8
ADMIN = auth(ADMIN_KEY)


def test_the_default_limit_is_a_setting() -> None:
    assert RouterSettings().max_replicas_per_model == 64
    assert RouterSettings(max_replicas_per_model=LIMIT).max_replicas_per_model == LIMIT


def test_a_catalog_file_past_the_limit_is_refused_naming_it() -> None:
    fixed = "models:\n  - {name: a, source: /w.gguf, replicas: 9}\n"
    auto = "models:\n  - {name: a, source: /w.gguf, autoscale: {max_replicas: 100000}}\n"
    with pytest.raises(ConfigError, match=r"models\[0\]\.replicas: 9 is more than"):
        parse_catalog(fixed, max_replicas=LIMIT)
    with pytest.raises(ConfigError, match=r"autoscale\.max_replicas: 100000 .*\(8\)"):
        parse_catalog(auto, max_replicas=LIMIT)
    assert parse_catalog(fixed, max_replicas=9)[0].replicas == 9


async def test_the_admin_api_refuses_counts_past_the_limit(tmp_path: Path) -> None:
    async with gateway(
        tmp_path / "s.db", [ready("r1", "m1", "http://e1:1")], [spec("m1")], max_replicas=LIMIT
    ) as gw:
        entry = {"name": "m2", "source": "/w.gguf", "replicas": LIMIT + 1}
        r = await gw.http.put("/admin/models/m2", json=entry, headers=ADMIN)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "replicas"
        assert f"LLMGW_MAX_REPLICAS_PER_MODEL ({LIMIT})" in error["message"]
        auto = {"name": "m2", "source": "/w.gguf", "autoscale": {"max_replicas": 10**6}}
        r = await gw.http.put("/admin/models/m2", json=auto, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "autoscale.max_replicas"
        r = await gw.http.put("/admin/models/m2", json={**entry, "replicas": LIMIT}, headers=ADMIN)
        assert r.status_code == 200, r.text

        for body, field in [
            ({"replicas": 1000}, "replicas"),
            ({"min_replicas": 1, "max_replicas": 10**6}, "max_replicas"),
        ]:
            r = await gw.http.post("/admin/models/m1/scale", json=body, headers=ADMIN)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field
            assert f"is more than LLMGW_MAX_REPLICAS_PER_MODEL ({LIMIT})" in error["message"]


async def test_llmgw_scale_refuses_counts_past_the_limit(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    store.put_model(spec("m1"), 1)
    # Refused while writing the catalog entry, before Temporal is asked.
    no_temporal = cast(Client, None)
    with pytest.raises(ConfigError, match=r"replicas: 100 is more than .*\(8\)"):
        await scale_model(no_temporal, store, "m1", 100, limit=LIMIT)
    with pytest.raises(ConfigError, match=r"autoscale\.max_replicas: 9 is more than"):
        await scale_model(no_temporal, store, "m1", None, 0, LIMIT + 1, limit=LIMIT)
    entry = get_entry(store, "m1")
    assert entry is not None and entry.replicas == 1
    store.close()
