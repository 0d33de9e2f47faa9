"""No import cycle between modules of the sglang package, nor between modules of the sgl_kernel package.

An import inside a function counts (it runs whenever the function does, and a cycle through it is a cycle of
real code). In sglang an import under `if TYPE_CHECKING:` does not (annotations only); in sgl_kernel it does: its
path modules share their types through leaf modules, so a kernel module never needs its caller's module, even for an
annotation. A failure names each cycle with the file and line of every import in it.
"""

from __future__ import annotations

import ast
import os
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_files(src: str, package: str) -> dict:
    """Dotted module name -> file, for every .py under src/package (a package's __init__ is the package)."""
    mods = {}
    for dirpath, _, files in os.walk(os.path.join(src, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, src)[:-3].replace(os.sep, ".")
                mods[mod.removesuffix(".__init__")] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False):
    """Every import statement that can run, and those under `if TYPE_CHECKING:` only when `type_checking`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _targets(node, mod: str, is_package: bool) -> list:
    """Modules an import statement loads (a `from pkg import sub` loads pkg and pkg.sub)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        parts = mod.split(".")[:len(mod.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(src: str, package: str, type_checking: bool = False) -> dict:
    """module -> {imported module: line of the first import}, for imports between modules of the package (those under
    `if TYPE_CHECKING:` too when `type_checking`)."""
    mods = module_files(src, package)
    graph = {}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges = graph.setdefault(mod, {})
        for node in _imports(tree, type_checking):
            for target in _targets(node, mod, path.endswith("__init__.py")):
                if target in mods and target != mod:
                    edges.setdefault(target, node.lineno)
    return graph


def find_cycles(graph: dict) -> list:
    """One shortest cycle (a list of modules, first == last) per strongly connected component of size > 1."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def connect(v):  # Tarjan; the package's import depth is far below the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_shortest_cycle(graph, comp) for comp in components]


def _shortest_cycle(graph: dict, comp: set) -> list:
    """Breadth-first from the component's first module until an edge leads back to it."""
    start = min(comp)
    parent, queue = {start: None}, deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if w in comp and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def describe(graph: dict, files: dict, cycle: list) -> str:
    steps = [f"  {a} -> {b}  ({os.path.relpath(files[a], ROOT)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "\n".join(["import cycle: " + " -> ".join(cycle)] + steps)


def test_sglang_has_no_import_cycle():
    src = os.path.join(ROOT, "python")
    graph, files = import_graph(src, "sglang"), module_files(src, "sglang")
    cycles = find_cycles(graph)
    assert not cycles, "\n".join(describe(graph, files, c) for c in cycles)


def test_sgl_kernel_has_no_import_cycle():
    """The kernels package, TYPE_CHECKING imports counted: e.g. no path module of the MoE imports its front door
    (sgl_kernel.dsv4_moe) back."""
    src = os.path.join(ROOT, "sgl-kernel", "python")
    graph, files = import_graph(src, "sgl_kernel", type_checking=True), module_files(src, "sgl_kernel")
    cycles = find_cycles(graph)
    assert not cycles, "\n".join(describe(graph, files, c) for c in cycles)


def test_checker_counts_lazy_imports_and_type_checking_where_asked(tmp_path):
    """The checker itself: a cycle through a function-level import is found; one through TYPE_CHECKING only when
    TYPE_CHECKING imports are counted."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\n")
    (pkg / "e.py").write_text("from . import d\n")
    graph = import_graph(str(tmp_path), "pkg")
    assert graph["pkg.e"] == {"pkg": 1, "pkg.d": 1} and graph["pkg.d"] == {}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    strict = import_graph(str(tmp_path), "pkg", type_checking=True)
    assert strict["pkg.d"] == {"pkg.e": 3}
    assert sorted(find_cycles(strict)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
