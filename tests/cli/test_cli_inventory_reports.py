"""`llmgw agent inventory` shows the engine capabilities and weights roots agents report."""

import json
from pathlib import Path

from tests.cli.test_cli_inventory import _inventory


def test_inventory_reports_capabilities_and_weights_roots(tmp_path: Path) -> None:
    result = _inventory(tmp_path, "mixed-node.json", "roce-2x", "--json")
    assert result.returncode == 0, result.stderr
    inv = json.loads(result.stdout)
    assert isinstance(inv["capabilities"], list)  # whatever llama.cpp this machine takes
    assert inv["weights"]["roots"] == [str((tmp_path / "models").resolve())]
    table = _inventory(tmp_path, "mixed-node.json", "roce-2x")
    assert "capabilities: " in table.stdout and "weights roots: " in table.stdout
