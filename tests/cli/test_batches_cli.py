"""``llmgw batches list/show`` (the real CLI on a real store): every key's
batches, newest first, in tables and ``--json``; and the documented shapes
(docs/reference/cli-json.md) against the models that print them."""

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from llmgw.store import Store
from llmgw.store.openai_tables import BatchRecord
from llmgw_cli.output import BatchesOutput, BatchShowOutput
from router.batches.records import insert_batch
from tests.cli.test_cli_json import _cli, _documented, _fields

T0 = 1_796_000_000  # 2026-11-30T...Z


def _batch(i: int, key_id: int, **fields: Any) -> BatchRecord:
    return BatchRecord(
        id=f"batch_{i:032x}", key_id=key_id, endpoint="/v1/chat/completions",
        input_file_id=f"file-in{i}", created_at=T0 + i, expires_at=T0 + i + 86400,
        **fields,
    )  # fmt: skip


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "s.db"
    store = Store(f"sqlite:///{path}")
    try:
        store.migrate()
        insert_batch(store, _batch(1, 7))
        insert_batch(
            store,
            _batch(
                2, 8, status="failed", total=3, failed_at=T0 + 9, meta={"job": "nightly"},
                errors=[{"code": "mismatched_url", "line": 2, "message": "m", "param": "url"}],
            ),
        )  # fmt: skip
        insert_batch(
            store,
            _batch(
                3, 7, status="completed", total=5, completed=4, failed=1, input_tokens=50,
                output_tokens=20, output_file_id="file-out3", error_file_id="file-err3",
                in_progress_at=T0 + 4, finalizing_at=T0 + 20, completed_at=T0 + 21,
            ),
        )  # fmt: skip
    finally:
        store.close()
    return path


def test_list_every_keys_batches_newest_first(db: Path) -> None:
    listed = _cli(db, "batches", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert [b["id"][-1] for b in data["batches"]] == ["3", "2", "1"]
    assert data["has_more"] is False
    assert data["batches"][0] == {
        "id": f"batch_{3:032x}", "key_id": 7, "endpoint": "/v1/chat/completions",
        "status": "completed", "total": 5, "completed": 4, "failed": 1,
        "created_at": "2026-11-30T00:53:23Z",
    }  # fmt: skip
    one_key = json.loads(_cli(db, "batches", "list", "--key", "7", "--json").stdout)
    assert [b["id"][-1] for b in one_key["batches"]] == ["3", "1"]
    newest = json.loads(_cli(db, "batches", "list", "--limit", "1", "--json").stdout)
    assert [b["id"][-1] for b in newest["batches"]] == ["3"] and newest["has_more"]
    table = _cli(db, "batches", "list")
    assert table.returncode == 0, table.stderr
    assert f"batch_{2:032x}" in table.stdout and "4/1/5" in table.stdout


def test_show_one_batch_in_full(db: Path) -> None:
    shown = _cli(db, "batches", "show", f"batch_{2:032x}", "--json")
    assert shown.returncode == 0, shown.stderr
    batch = json.loads(shown.stdout)["batch"]
    assert batch["status"] == "failed" and batch["failed_at"] == "2026-11-30T00:53:29Z"
    assert batch["errors"] == [
        {"code": "mismatched_url", "line": 2, "message": "m", "param": "url"}
    ]
    assert batch["metadata"] == {"job": "nightly"} and batch["completed_at"] is None
    done = json.loads(_cli(db, "batches", "show", f"batch_{3:032x}", "--json").stdout)["batch"]
    assert (done["output_file_id"], done["error_file_id"]) == ("file-out3", "file-err3")
    assert (done["input_tokens"], done["output_tokens"]) == (50, 20)
    text = _cli(db, "batches", "show", f"batch_{3:032x}")
    assert text.returncode == 0 and "4 completed, 1 failed" in text.stdout
    missing = _cli(db, "batches", "show", "batch_nope", "--json")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "no batch 'batch_nope'" in missing.stderr


SHAPES: dict[str, type[BaseModel]] = {
    "llmgw batches list --json": BatchesOutput,
    "llmgw batches show ID --json": BatchShowOutput,
}


@pytest.mark.parametrize("title", sorted(SHAPES))
def test_the_documented_example_is_the_shape_printed(title: str) -> None:
    documented = _documented()
    assert title in documented, sorted(documented)
    body, example = documented[title]
    shape = SHAPES[title]
    assert json.loads(shape.model_validate(example).model_dump_json()) == example
    missing = {f for f in _fields(shape) if f"`{f}`" not in body}
    assert not missing, f"{title}: fields not in its table: {missing}"
