"""The dependency rule between the packages, read from the tree on disk.

The project's packages are the directories at the repository's root that hold
an ``__init__.py`` (``tests/`` and ``docs/`` aside), and every directory with
an ``__init__.py`` under them. Each of those ``__init__.py`` files declares
its package's layer, once::

    LAYER = "gateway"

and a module's layer is its package's: the directory it sits in. A new
directory fails this test until its ``__init__.py`` says where it stands (a
directory of modules without one fails too), so nothing lands in a layer by
default. The layers, lowest first::

    core  <  store  <  plans  <  control | agent | gateway  <  cli

A module may import its own layer and the layers below it, nothing else.
Control (``workflows/``, ``activities/control/``), agent (``worker_agent/``,
``activities/agent/``) and gateway (``router/``) are separate processes and
never import each other: what they share is below them. Engine plans
(``worker_agent/engines/``) are pure command lines and checks, so the control
worker validates launches with them without the agent's runtime. The CLI
(``llmgw_cli/``, its ``dev/`` tiny models included) is above everything it
starts. Tests sit above everything and are not checked.

No cycles either, at two grains:

- between packages: package A -> package B when a module directly in A's
  directory imports a module directly in B's. A package importing its own
  sub-package (or the reverse) is an arrow like any other: a directory is one
  room, so a package's own modules stand wholly above its sub-packages or
  wholly below them, never both;
- between modules (strongly connected components, Tarjan).

Every import counts, function-local and ``TYPE_CHECKING`` ones included: the
rule is about what a process needs, not when it loads it. Importing
``a.b.c`` is an arrow to ``a.b.c`` (and ``from a.b import c`` also to
``a.b``'s ``__init__``); the parent packages' ``__init__`` files Python runs
on the way count only when imported by name. There are no per-module
exceptions.
"""

import ast
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_PACKAGES = frozenset({"tests", "docs"})
RANK = {
    "core": 0,
    "store": 1,
    "plans": 2,
    "control": 3,
    "agent": 3,
    "gateway": 3,
    "cli": 4,
}


@dataclass
class Tree:
    """The packages and modules under one root, and the imports between them."""

    root: Path
    # Dotted package name -> its directory.
    packages: dict[str, Path] = field(default_factory=dict)
    # Dotted module name -> its file (a package's own module is its __init__.py).
    modules: dict[str, Path] = field(default_factory=dict)
    # (importer, imported module) -> the names it takes ("" for a bare import).
    edges: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    # Dotted package name -> its declared layer (None: none, or more than one).
    layers: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def read(cls, root: Path) -> "Tree":
        tree = cls(root)
        tops = [
            d
            for d in sorted(root.iterdir())
            if d.is_dir()
            and d.name not in NOT_PACKAGES
            and not d.name.startswith(".")
            and (d / "__init__.py").is_file()
        ]
        for top in tops:
            for init in sorted(top.rglob("__init__.py")):
                tree.packages[tree.dotted(init.parent)] = init.parent
                tree.layers[tree.dotted(init.parent)] = _declared_layer(init)
            for path in sorted(top.rglob("*.py")):
                if "__pycache__" not in path.parts:
                    tree.modules[tree.module_name(path)] = path
        for name, path in tree.modules.items():
            for dotted, taken in _imported(name, path, {t.name for t in tops}):
                target = tree.resolve(dotted)
                if target and target != name:
                    tree.edges.setdefault((name, target), set()).add(taken)
        return tree

    def dotted(self, directory: Path) -> str:
        return ".".join(directory.relative_to(self.root).parts)

    def module_name(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)

    def resolve(self, dotted: str) -> str | None:
        """The module an imported dotted name lands in (``a.b.name`` -> ``a.b``)."""
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def package_of(self, module: str) -> str:
        """The nearest package: the directory the module sits in."""
        name = module
        while name not in self.packages:
            if "." not in name:
                raise KeyError(f"{module} is in no package")
            name = name.rpartition(".")[0]
        return name

    def layer(self, module: str) -> str | None:
        return self.layers[self.package_of(module)]

    def stray_dirs(self) -> list[str]:
        """Directories holding modules under a package without being packages."""
        return sorted(
            {
                self.dotted(p.parent)
                for p in self.modules.values()
                if not (p.parent / "__init__.py").is_file()
            }
        )

    def package_edges(self) -> dict[tuple[str, str], set[tuple[str, str]]]:
        """(package, package) -> the module imports that make that arrow."""
        lifted: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
        for a, b in self.edges:
            pa, pb = self.package_of(a), self.package_of(b)
            if pa != pb:
                lifted[pa, pb].add((a, b))
        return dict(lifted)


def _declared_layer(init: Path) -> str | None:
    values = [
        node.value.value
        for node in ast.parse(init.read_text(), str(init)).body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["LAYER"]
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    return values[0] if len(values) == 1 else None


def _imported(name: str, path: Path, tops: set[str]) -> set[tuple[str, str]]:
    """(dotted name, name taken) for each import of the project's packages.

    ``from a import b`` yields ``(a, "b")`` and ``(a.b, "b")``; ``import a.b``
    yields ``(a.b, "")``.
    """
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                found.update({(module, alias.name), (f"{module}.{alias.name}", alias.name)})
    return {(dotted, taken) for dotted, taken in found if dotted.split(".")[0] in tops}


def strongly_connected(
    nodes: Iterable[str], edges: Iterable[tuple[str, str]]
) -> set[frozenset[str]]:
    """The components of more than one node (Tarjan's algorithm)."""
    tarjan = _Tarjan(edges)
    for node in sorted(set(nodes)):
        if node not in tarjan.index:
            tarjan.run(node)
    return tarjan.found


class _Tarjan:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""

    def __init__(self, edges: Iterable[tuple[str, str]]) -> None:
        self.succ: dict[str, list[str]] = defaultdict(list)
        for a, b in sorted(edges):
            self.succ[a].append(b)
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.on_stack: set[str] = set()
        self.work: list[tuple[str, Iterator[str]]] = []
        self.found: set[frozenset[str]] = set()

    def run(self, start: str) -> None:
        self._visit(start)
        while self.work:
            v, successors = self.work[-1]
            for w in successors:
                if w not in self.index:
                    self._visit(w)
                    break
                if w in self.on_stack:
                    self.low[v] = min(self.low[v], self.index[w])
            else:
                self._finish(v)

    def _visit(self, v: str) -> None:
        self.index[v] = self.low[v] = len(self.index)
        self.stack.append(v)
        self.on_stack.add(v)
        self.work.append((v, iter(self.succ[v])))

    def _finish(self, v: str) -> None:
        self.work.pop()
        if self.work:
            parent = self.work[-1][0]
            self.low[parent] = min(self.low[parent], self.low[v])
        if self.low[v] == self.index[v]:
            component = {v}
            while (w := self.stack.pop()) != v:
                component.add(w)
            self.on_stack.difference_update(component)
            if len(component) > 1:
                self.found.add(frozenset(component))


def allowed(tree: Tree, importer: str, imported: str) -> bool:
    """Whether the rule lets ``importer`` import ``imported``."""
    a, b = tree.layer(importer), tree.layer(imported)
    assert a in RANK, f"{importer}: package {tree.package_of(importer)} has no layer"
    assert b in RANK, f"{imported}: package {tree.package_of(imported)} has no layer"
    return a == b or RANK[b] < RANK[a]


def _describe(component: frozenset[str], arrows: dict[tuple[str, str], set[str]]) -> str:
    """A cycle's members and every arrow inside it, with what each one carries."""
    lines = ["  {" + ", ".join(sorted(component)) + "}"]
    for (a, b), what in sorted(arrows.items()):
        if a in component and b in component:
            lines.append(f"      {a} -> {b}: {', '.join(sorted(what))}")
    return "\n".join(lines)


def _check_cycles(
    kind: str, found: set[frozenset[str]], arrows: dict[tuple[str, str], set[str]]
) -> None:
    """No cycle at all: each one found is printed with the imports that make it."""
    cycles = sorted(found, key=sorted)
    assert not cycles, f"{kind} cycles:\n" + "\n".join(_describe(c, arrows) for c in cycles)


@cache
def _tree() -> Tree:
    return Tree.read(ROOT)


def _package_arrows(tree: Tree) -> dict[tuple[str, str], set[str]]:
    return {
        pair: {f"{a} -> {b}" for a, b in imports} for pair, imports in tree.package_edges().items()
    }


def _module_arrows(tree: Tree) -> dict[tuple[str, str], set[str]]:
    return {pair: {t or "(the module)" for t in taken} for pair, taken in tree.edges.items()}


def test_every_package_declares_its_layer() -> None:
    tree = _tree()
    assert {"llmgw", "llmgw_cli", "router", "workflows", "worker_agent"} <= tree.packages.keys()
    undeclared = sorted(p for p, layer in tree.layers.items() if layer not in RANK)
    assert not undeclared, (
        "packages without one LAYER = <one of "
        + ", ".join(RANK)
        + "> in their __init__.py:\n"
        + "\n".join(f"  {tree.packages[p].relative_to(ROOT)}/__init__.py" for p in undeclared)
    )


def test_every_directory_of_modules_is_a_package() -> None:
    stray = _tree().stray_dirs()
    assert not stray, f"directories of modules without an __init__.py (so no layer): {stray}"


def test_imports_follow_the_rule() -> None:
    tree = _tree()
    broken = sorted((a, b) for a, b in tree.edges if not allowed(tree, a, b))
    assert not broken, "imports against the dependency rule:\n" + "\n".join(
        f"  {a} ({tree.layer(a)}) -> {b} ({tree.layer(b)})" for a, b in broken
    )


def test_no_cycle_between_packages() -> None:
    tree = _tree()
    found = strongly_connected(tree.packages, tree.package_edges())
    _check_cycles("package", found, _package_arrows(tree))


def test_no_cycle_between_modules() -> None:
    tree = _tree()
    found = strongly_connected(tree.modules, tree.edges)
    _check_cycles("module", found, _module_arrows(tree))


def test_the_rule_itself() -> None:
    tree = _tree()
    assert tree.layer("llmgw.types") == "core"
    assert tree.layer("llmgw.store.gateway_tables") == "store"
    assert tree.layer("worker_agent.engines.vllm") == "plans"
    assert tree.layer("activities.control.replicas") == "control"
    assert tree.layer("activities.agent.shards") == "agent"
    assert tree.layer("router.api.admin") == "gateway"
    assert tree.layer("llmgw_cli.dev.tinymodel") == "cli"
    assert allowed(tree, "router.api.admin", "llmgw.store")
    assert allowed(tree, "activities.control.replicas", "worker_agent.engines.validation")
    assert allowed(tree, "llmgw_cli.up", "llmgw_cli.dev.tinymodel")
    assert allowed(tree, "llmgw_cli.up", "router.main")
    assert not allowed(tree, "worker_agent.engines.vllm", "worker_agent.supervisor")
    assert not allowed(tree, "workflows.worker", "worker_agent.main")
    assert not allowed(tree, "activities.control.replicas", "worker_agent.launch")
    assert not allowed(tree, "router.api.admin", "workflows.replica")
    assert not allowed(tree, "llmgw.store", "router.app")
    assert not allowed(tree, "llmgw.types", "llmgw.store")
    assert not allowed(tree, "router.app", "llmgw_cli.up")


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_on_a_made_up_tree(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "low/__init__.py": '"""Doc."""\n\nLAYER = "core"\n',
            "low/base.py": "from high.top import thing\n",
            "low/loose/__init__.py": "",
            "low/loose/one.py": "def f():\n    from ..base import x\n",
            "low/noinit/stray.py": "",
            "high/__init__.py": 'LAYER = "gateway"\n',
            "high/top.py": "import low.base\n",
            "high/twice/__init__.py": 'LAYER = "gateway"\nLAYER = "cli"\n',
            "nest/__init__.py": 'LAYER = "cli"\n',
            "nest/composes.py": "from nest.sub.deep import y\n",
            "nest/common.py": "",
            "nest/sub/__init__.py": 'LAYER = "cli"\n',
            "nest/sub/deep.py": "from nest import common\n",
            "tests/__init__.py": "",
            "tests/test_x.py": "import high.top\n",
            "notapackage/script.py": "import low.base\n",
            ".hidden/__init__.py": "",
        },
    )
    tree = Tree.read(tmp_path)
    # No LAYER, and two of them, both count as undeclared.
    assert tree.layers == {
        "low": "core",
        "low.loose": None,
        "high": "gateway",
        "high.twice": None,
        "nest": "cli",
        "nest.sub": "cli",
    }
    assert tree.stray_dirs() == ["low.noinit"]
    assert tree.package_of("low.noinit.stray") == "low"
    assert tree.edges[("low.loose.one", "low.base")] == {"x"}
    assert tree.edges[("nest.sub.deep", "nest")] == {"common"}
    assert tree.edges[("high.top", "low.base")] == {""}
    assert tree.edges[("nest.sub.deep", "nest.common")] == {"common"}
    assert not allowed(tree, "low.base", "high.top")
    assert allowed(tree, "high.top", "low.base")
    assert allowed(tree, "nest.sub.deep", "high.top")
    assert strongly_connected(tree.modules, tree.edges) == {frozenset({"low.base", "high.top"})}
    # A package and its own sub-package importing each other is a cycle too.
    assert strongly_connected(tree.packages, tree.package_edges()) == {
        frozenset({"low", "high"}),
        frozenset({"nest", "nest.sub"}),
    }
    _check_cycles("made-up", set(), {})
    with pytest.raises(AssertionError, match="low -> high: x"):
        _check_cycles("made-up", {frozenset({"low", "high"})}, {("low", "high"): {"x"}})


def test_strongly_connected_against_reachability() -> None:
    rng = random.Random(24)
    for _ in range(200):
        nodes = [f"m{i}" for i in range(rng.randint(1, 12))]
        edges = {(rng.choice(nodes), rng.choice(nodes)) for _ in range(rng.randint(0, 20))}
        reach = {n: {n} for n in nodes}
        for _ in nodes:
            for a, b in edges:
                reach[a] |= reach[b]
        expected = {frozenset(m for m in nodes if m in reach[n] and n in reach[m]) for n in nodes}
        assert strongly_connected(nodes, edges) == {c for c in expected if len(c) > 1}
