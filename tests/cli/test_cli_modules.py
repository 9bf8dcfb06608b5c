"""The CLI's modules import one way: ``app`` registers the commands and
sub-apps, which share what they need through ``common``; no module of
``llmgw_cli`` imports ``app`` (but the entry points), and there is no cycle
between them, counting imports inside functions too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmgw_cli"
ENTRY_POINTS = {"llmgw_cli", "llmgw_cli.__main__"}


def _name(path: Path) -> str:
    parts = ["llmgw_cli", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _edges() -> dict[str, set[str]]:
    """Each CLI module and the CLI modules it imports, anywhere in it."""
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        edges[name] = {f for f in found if f in modules and f != name}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle (its modules in order), or [] when there is none."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for target in sorted(edges[module]):
            if found := visit(target, [*path, module]):
                return found
        done.add(module)
        return []

    for module in sorted(edges):
        if found := visit(module, []):
            return found
    return []


def test_no_cli_module_imports_app_but_the_entry_points() -> None:
    importers = {m for m, targets in _edges().items() if "llmgw_cli.app" in targets}
    assert importers <= ENTRY_POINTS, importers - ENTRY_POINTS


def test_no_import_cycle_between_cli_modules() -> None:
    assert _cycle(_edges()) == []


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
