"""The dependency rule between the packages, read from every module's imports.

Each module belongs to one room; a room may import its own modules and the
rooms of lower rank, nothing else::

    shared core  <  store  <  engine plans  <  control | agent | gateway  <  dev  <  CLI

Control (``workflows/``, ``activities/control``), agent (``worker_agent/``,
``activities/node``, ``activities/adapters``) and gateway (``router/``) are
separate processes and never import each other: what they share is in the
rooms below them. Engine plans (``worker_agent/engines/``) are pure command
lines and checks, so the control worker validates launches with them without
the agent's runtime. Tests sit above everything and are not checked.

Every import counts, function-local and ``TYPE_CHECKING`` ones included: the
rule is about what a process needs, not when it loads it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("llmgw", "workflows", "activities", "worker_agent", "router")

# Longest matching prefix wins.
ROOMS = {
    "llmgw": "core",
    # The activity names are the contract between the control worker and the agent.
    "activities": "core",
    "activities.names": "core",
    "llmgw.store": "store",
    # The gateway's tables are part of the one schema every process creates.
    "llmgw.store.gateway_tables": "store",
    "llmgw.store.catalog_store": "store",
    "worker_agent.engines": "plans",
    "workflows": "control",
    "activities.control.replicas": "control",
    "worker_agent": "agent",
    "activities.agent.shards": "agent",
    "activities.agent.adapters": "agent",
    "router": "gateway",
    # Tiny-model generators: development and test support, used by `llmgw up`.
    "llmgw_cli.dev": "dev",
    "llmgw_cli": "cli",
    "llmgw_cli.__main__": "cli",
}
RANK = {
    "core": 0,
    "store": 1,
    "plans": 2,
    "control": 3,
    "agent": 3,
    "gateway": 3,
    "dev": 4,
    "cli": 5,
}

# Imports that break the rule today, each with why it is still there. Only
# ever remove entries: a stale one fails the test.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
    }


def _imported(name: str, path: Path) -> set[str]:
    """Dotted names a module imports (``from a import b`` yields ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {f for f in found if f.split(".")[0] in PACKAGES}


def _resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def room(module: str) -> str:
    """The room a module belongs to (the longest matching prefix in ``ROOMS``)."""
    matches = [p for p in ROOMS if module == p or module.startswith(p + ".")]
    return ROOMS[max(matches, key=len)]


def allowed(importer: str, imported: str) -> bool:
    """Whether the rule lets ``importer`` import ``imported``."""
    a, b = room(importer), room(imported)
    return a == b or RANK[b] < RANK[a]


def import_edges() -> set[tuple[str, str]]:
    """Every (importer, imported module) pair between modules of the packages."""
    modules = _modules()
    edges: set[tuple[str, str]] = set()
    for name, path in modules.items():
        for dotted in _imported(name, path):
            target = _resolve(dotted, modules)
            if target and target != name:
                edges.add((name, target))
    return edges


def test_every_module_has_a_room() -> None:
    assert all(room(m) in RANK for m in _modules())


def test_imports_follow_the_rule() -> None:
    broken = {(a, b) for a, b in import_edges() if not allowed(a, b)}
    new = sorted(broken - EXCEPTIONS.keys())
    assert not new, "imports against the dependency rule:\n" + "\n".join(
        f"  {a} ({room(a)}) -> {b} ({room(b)})" for a, b in new
    )
    stale = sorted(EXCEPTIONS.keys() - broken)
    assert not stale, f"exceptions no longer needed, remove them: {stale}"


def test_the_rule_itself() -> None:
    assert allowed("router.api.admin", "llmgw.store")
    assert allowed("activities.control.replicas", "worker_agent.engines.validation")
    assert not allowed("worker_agent.engines.vllm", "worker_agent.supervisor")
    assert not allowed("workflows.worker", "worker_agent.main")
    assert not allowed("activities.control.replicas", "worker_agent.launch")
    assert not allowed("router.api.admin", "workflows.replica")
    assert not allowed("llmgw.store", "router.app")
    assert not allowed("llmgw.types", "llmgw.store")
