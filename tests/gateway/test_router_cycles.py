"""No import cycle between the router's modules: each room's modules import
one way (the queue makes waiting streams, which know the queue by a
Protocol; the raw upstream makes answers, which know their connection by a
Protocol). tests/test_layers.py checks the whole tree; this names the
router's own cycles, with their modules, where a change inside it makes one.
Every import counts, function-local and TYPE_CHECKING ones included."""

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "router"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ROUTER.rglob("*.py")):
        parts = ["router", *path.relative_to(ROUTER).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the router modules it imports (``from a import b``: ``a``,
    and ``a.b`` too where that is a module)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                names = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for dotted in names:
                target = dotted
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_of_the_router_imports_itself_round_a_cycle() -> None:
    found = cycles(_edges(_modules()))
    assert not found, "module cycles in router/:\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found
    )
