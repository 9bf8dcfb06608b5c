"""``llmgw keys create/update --weight --priority``: a key's share and class in
the admission queue, stored with the key (columns added by ``migrate``)."""

import os
import subprocess
import sys
from pathlib import Path

from llmgw.store import Store
from llmgw.types import Priority
from router.api.apikeys import list_keys


def _cli(db: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMGW_STORE_URL": f"sqlite:///{db}", "COLUMNS": "250"}
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "keys", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_weight_and_priority_are_set_changed_and_checked(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    made = _cli(db, "create", "batchy", "--weight", "3", "--priority", "batch")
    assert made.returncode == 0, made.stderr
    plain = _cli(db, "create", "plain")
    assert plain.returncode == 0, plain.stderr
    store = Store(f"sqlite:///{db}")
    try:
        batchy, default = list_keys(store)
        assert (batchy.policy.weight, batchy.policy.priority) == (3.0, Priority.BATCH)
        assert (default.policy.weight, default.policy.priority) == (1.0, Priority.NORMAL)
        changed = _cli(db, "update", str(batchy.id), "--priority", "high")
        assert changed.returncode == 0, changed.stderr
        assert "weight 3, priority high" in changed.stderr
        assert list_keys(store)[0].policy.priority is Priority.HIGH
        assert list_keys(store)[0].policy.weight == 3.0  # what was not given stays
        assert "weight 3, high" in _cli(db, "list").stdout
    finally:
        store.close()
    bad = _cli(db, "create", "x", "--priority", "urgent")
    assert bad.returncode != 0 and "priority" in bad.stderr
    zero = _cli(db, "update", "1", "--weight", "0")
    assert zero.returncode != 0 and "weight" in zero.stderr
