"""``--json`` of ``llmgw keys list`` and ``llmgw model list/show`` (the real
CLI on a real store), and the documented shapes (docs/reference/cli-json.md)
against the models that print them. ``status``, ``explain`` and ``scale``
need a control plane: tests/e2e/test_elastic_cli.py; explain's sentence on shared
nodes is tested here."""

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import BaseModel

from llmgw.catalog import CatalogModel, parse_catalog
from llmgw.store import Store
from llmgw.store.catalog_store import list_entries
from llmgw.types import AutoscalePolicy, ModelSpec
from llmgw_cli.output import (
    DeploymentRow,
    ExplainOutput,
    KeysOutput,
    ModelsOutput,
    SharedNode,
    StatusOutput,
)
from router.api.apikeys import create_key, list_keys, revoke_key
from router.billing.key_policy import KeyPolicy

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli-json.md"

KEY_FIELDS = {
    "id", "name", "prefix", "created_at", "state", "models", "expires_at", "rpm", "tpm",
    "token_budget", "budget_period", "weight", "priority",
}  # fmt: skip


def _cli(db: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMGW_STORE_URL": f"sqlite:///{db}", "COLUMNS": "250"}
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_keys_list_json_has_the_policy_and_never_the_key(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = Store(f"sqlite:///{db}")
    try:
        store.migrate()
        expires = datetime(2030, 1, 2, 3, 4, tzinfo=UTC)
        _, plain = create_key(store, "plain", KeyPolicy())
        limited, secret = create_key(
            store, "limited",
            KeyPolicy(models=["m1", "m2"], expires_at=expires, rpm=7, tpm=70, token_budget=700,
                      budget_period="month", weight=2.5, priority="batch"),
        )  # fmt: skip
        admin, admin_secret = create_key(store, "ops", KeyPolicy(admin=True))
        revoke_key(store, admin.id)
        stored = {k.id: k for k in list_keys(store)}
    finally:
        store.close()

    listed = _cli(db, "keys", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    for key in (plain, secret, admin_secret):
        assert key not in listed.stdout
        assert key[len(limited.prefix) :] not in listed.stdout
    data = json.loads(listed.stdout)
    assert set(data) == {"keys"}
    rows = data["keys"]
    assert [r["id"] for r in rows] == sorted(stored)
    assert all(set(r) == KEY_FIELDS for r in rows)
    by_name = {r["name"]: r for r in rows}
    assert by_name["limited"] == {
        "id": limited.id, "name": "limited", "prefix": limited.prefix,
        "created_at": stored[limited.id].created_at.isoformat().replace("+00:00", "Z"),
        "state": "active", "models": ["m1", "m2"], "expires_at": "2030-01-02T03:04:00Z",
        "rpm": 7, "tpm": 70, "token_budget": 700, "budget_period": "month", "weight": 2.5,
        "priority": "batch",
    }  # fmt: skip
    assert secret.startswith(by_name["limited"]["prefix"])
    assert by_name["ops"]["state"] == "revoked"  # revoked wins over admin, as in the table
    assert (by_name["plain"]["state"], by_name["plain"]["expires_at"]) == ("active", None)
    assert by_name["plain"]["models"] == [] and by_name["plain"]["priority"] == "normal"


def test_model_list_and_show_json_are_the_catalog_entries(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = Store(f"sqlite:///{db}")
    try:
        store.migrate()
        store.put_model(ModelSpec(name="b-fixed", source="/w/b.gguf", gpus=2, priority=3), 2)
        scaled = ModelSpec(
            name="a-scaled", source="/w/a.gguf",
            autoscale=AutoscalePolicy(min_replicas=0, max_replicas=3), engine_args=["-c", "64"],
        )  # fmt: skip
        store.put_model(scaled, 1)
        entries = list_entries(store)
    finally:
        store.close()

    listed = _cli(db, "model", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert set(data) == {"models"}
    assert [m["name"] for m in data["models"]] == ["a-scaled", "b-fixed"]
    expected = [e.model_dump(mode="json") for e in entries]
    assert data["models"] == expected  # every field, defaults included
    assert set(data["models"][0]) == set(CatalogModel.model_fields)
    assert data["models"][1]["replicas"] == 2 and data["models"][1]["gpus"] == 2
    assert data["models"][0]["autoscale"]["max_replicas"] == 3

    shown = _cli(db, "model", "show", "b-fixed", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == expected[1]
    # Without --json: a catalog file that apply reads back to the same entry.
    as_yaml = _cli(db, "model", "show", "a-scaled")
    assert as_yaml.returncode == 0, as_yaml.stderr
    assert parse_catalog(as_yaml.stdout) == [entries[0]]
    table = _cli(db, "model", "list")
    assert table.returncode == 0 and "autoscale 0..3 replicas" in table.stdout
    missing = _cli(db, "model", "show", "nope", "--json")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "not in the catalog (have: a-scaled, b-fixed)" in missing.stderr


def _documented() -> dict[str, tuple[str, object]]:
    """Each ``## llmgw ... --json`` section of the page: its text and its
    JSON example (None where it has none)."""
    sections = re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]
    found: dict[str, tuple[str, object]] = {}
    for section in sections:
        title, _, body = section.partition("\n")
        example = re.search(r"```json\n(.*?)\n```", body, re.S)
        found[title.strip()] = (body, json.loads(example.group(1)) if example else None)
    return found


SHAPES: dict[str, type[BaseModel]] = {
    "llmgw status --json": StatusOutput,
    "llmgw explain MODEL --json": ExplainOutput,
    "llmgw scale MODEL ... --json": DeploymentRow,
    "llmgw keys list --json": KeysOutput,
    "llmgw model list --json": ModelsOutput,
}


def _fields(shape: type[BaseModel]) -> set[str]:
    """Field names of ``shape`` and of the shapes inside it (not the catalog's:
    reference/catalog.md documents those)."""
    names = set(shape.model_fields)
    for field in shape.model_fields.values():
        for inner in re.findall(r"llmgw_cli\.output\.(\w+)", str(field.annotation)):
            names |= _fields(getattr(sys.modules["llmgw_cli.output"], inner))
    return names


@pytest.mark.parametrize("title", sorted(SHAPES))
def test_the_documented_example_is_the_shape_printed(title: str) -> None:
    documented = _documented()
    assert title in documented, sorted(documented)
    body, example = documented[title]
    shape = SHAPES[title]
    # The example is complete and exact: it round-trips through the model.
    assert json.loads(shape.model_validate(example).model_dump_json()) == example
    if shape is not DeploymentRow:  # scale's section points at status's table
        missing = {f for f in _fields(shape) if f"`{f}`" not in body}
        assert not missing, f"{title}: fields not in its table: {missing}"


def test_explain_says_which_replicas_share_a_node_and_why() -> None:
    why = "no other node fits (n2: CPU replica slots full (1/1))"
    placed = SharedNode(node_id="n1", replicas=["r-a", "r-b"], new_replica=False, reason=why)
    assert placed.line("tiny") == f"tiny: replicas r-a and r-b share node n1: {why}"
    three = placed.model_copy(update={"replicas": ["r-a", "r-b", "r-c"]})
    assert three.line("tiny").startswith("tiny: replicas r-a, r-b and r-c share node n1: ")
    new = SharedNode(node_id="n1", replicas=["r-a"], new_replica=True, reason=why)
    assert new.line("tiny") == f"tiny: a new replica would share node n1 with r-a: {why}"
