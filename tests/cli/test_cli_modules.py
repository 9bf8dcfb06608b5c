"""The CLI's modules import one way: ``app`` registers the commands and
sub-apps, which share what they need through ``common``; no module of
``llmgw_cli`` imports ``app`` but the entry points (imports inside functions
count). Cycles between modules, here as everywhere, are tests/test_layers.py's."""

from pathlib import Path

from tests.test_layers import Tree

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"llmgw_cli", "llmgw_cli.__main__"}


def test_no_cli_module_imports_app_but_the_entry_points() -> None:
    importers = {a for a, b in Tree.read(ROOT).edges if b == "llmgw_cli.app"}
    assert importers, "the entry points import app: the walk saw no import of it"
    assert importers <= ENTRY_POINTS, importers - ENTRY_POINTS
