"""The import graph of gossiprec: no cycles, layers that import only downward, modules of a readable size.

The graph is read from the source with :mod:`ast`, not from ``sys.modules``: every ``import`` and
``from ... import`` anywhere in a module counts, at its top, inside a function (a deferred import) or
under ``if TYPE_CHECKING:``, with relative imports resolved. A deferred import still ties two modules
together; it only postpones the moment the tie is felt.

The layers:

* ``gossiprec.core`` (the sans-IO protocol) imports nothing of gossiprec outside itself except
  ``gossiprec.errors``, the exception types every layer shares;
* ``gossiprec.local`` (the trainer <-> agent channel and the launch contract) imports neither the agent
  nor the trainer: both sides import it;
* the trainer does not import the agent, and the agent does not import the trainer: what passes between
  them is the launch contract (:mod:`gossiprec.local.launch`) and the control protocol.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gossiprec"
MAX_LINES = 800
"""Most lines a module may have (house style: one concern per module)."""
BIG_THREE_MAX_LINES = 700
BIG_THREE = ("gossiprec.core.node", "gossiprec.core.membership", "gossiprec.trainer.loop")
"""Modules that grew past the others: held to a tighter limit, so that they do not grow back."""
CORE_MAY_IMPORT = frozenset({"gossiprec.errors"})
"""What the core may import of gossiprec outside ``gossiprec.core``."""
FORBIDDEN = (
    ("gossiprec.trainer", "gossiprec.agent"),
    ("gossiprec.local", "gossiprec.agent"),
    ("gossiprec.local", "gossiprec.trainer"),
    ("gossiprec.agent", "gossiprec.trainer"),
)
"""(importer's package, imported package) pairs that must not occur."""


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name (a package by its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names ``node`` imports, relative ones resolved against module ``name``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the longest module name each import names)."""
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(name, path, node)
            if isinstance(node, ast.ImportFrom):
                # the submodules it names, and the module it names when it names anything else in it
                named = [t for t in targets[:-1] if t in mods]
                targets = named + (targets[-1:] if len(named) < len(node.names) else [])
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle of each component of :func:`components`, as the path ``a -> b -> ... -> a`` from its
    first module in sorted order, the shortest there is."""
    return sorted((_shortest_cycle(graph, comp) for comp in components(graph)), key=lambda c: (len(c), c))


def _shortest_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its component")  # a component has one


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks a layer rule, as ``importer -> imported (rule)``."""
    out = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            if (_inside(importer, "gossiprec.core") and not _inside(target, "gossiprec.core")
                    and target not in CORE_MAY_IMPORT):
                out.append(f"{importer} -> {target} (the core imports only itself and "
                           f"{', '.join(sorted(CORE_MAY_IMPORT))})")
            for low, high in FORBIDDEN:
                if _inside(importer, low) and _inside(target, high):
                    out.append(f"{importer} -> {target} ({low} never imports {high})")
    return out


def oversized(mods: dict[str, Path]) -> list[str]:
    """Every module over its line limit, as ``module: N lines (limit L)``."""
    out = []
    for name, path in sorted(mods.items()):
        limit = BIG_THREE_MAX_LINES if name in BIG_THREE else MAX_LINES
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{name}: {n} lines (limit {limit})")
    return out


def test_the_graph_counts_deferred_and_type_checking_imports() -> None:
    graph = import_graph()
    assert len(graph) > 100
    assert "gossiprec.agent.torchrun" in graph["gossiprec.agent.torchrun_entry"]  # inside a function
    assert "gossiprec.core.machine" in graph["gossiprec.agent.status"]  # under TYPE_CHECKING
    assert "gossiprec.local.launch" in graph["gossiprec.trainer.settings"]  # at the top
    assert "gossiprec" in graph["gossiprec.cli"]  # from gossiprec import __version__: the package itself


def test_relative_imports_resolve(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\nfrom . import c\n")
    (pkg / "c.py").write_text("def f():\n    from .sub.b import X\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import X\n")
    (pkg / "sub" / "b.py").write_text("from ..c import f\nX = 1\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b", "pkg.c"}
    assert graph["pkg.c"] == {"pkg.sub.b"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.c", "pkg.sub.b", "pkg.c"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = [f"{' -> '.join(_shortest_cycle(graph, comp))}  (tangled: {', '.join(sorted(comp))})"
             for comp in components(graph)]
    assert not found, "import cycles:\n  " + "\n  ".join(sorted(found))


def test_layers_import_only_downward() -> None:
    found = forbidden_imports(import_graph())
    assert not found, "forbidden imports:\n  " + "\n  ".join(found)


def test_modules_stay_small() -> None:
    found = oversized(modules())
    assert not found, "modules over their line limit:\n  " + "\n  ".join(found)
