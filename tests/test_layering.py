"""Layering of the ``elasticfw`` package: no import circles, and the core never imports the plugins.

The import graph is read from the source with :mod:`ast`, not by importing: every ``import`` and
``from ... import`` counts, at module level and inside functions and classes alike (an import moved
into a function still makes a circle; it only hides it until the function runs). Relative imports
are resolved. Only imports under ``if TYPE_CHECKING:`` are left out: they never run.

``from pkg import name`` depends on the submodule ``pkg.name`` when there is one, else on ``pkg``
(its ``__init__``); importing a submodule does not count as depending on the packages above it.
Imports by string (``importlib.import_module``, entry points) are not seen.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "elasticfw"

#: an import: (importing module, imported module or name as written and resolved, line number)
Edge = tuple[str, str, int]


# -- reading imports --------------------------------------------------------------------------------


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file of ``root/package`` (``__init__`` is the package)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, source: str, *, is_package: bool) -> list[tuple[str, str | None, int]]:
    """Every import in ``source`` (of ``module``) outside ``if TYPE_CHECKING:`` blocks, as
    ``(absolute module, imported name or None, line)``: ``import a.b`` gives ``("a.b", None, ..)``,
    ``from .x import y`` gives ``("<package>.x", "y", ..)``."""
    found: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the else branch runs
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.extend((target, alias.name, node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def import_graph(root: Path, package: str) -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """The package's modules → the package's modules each imports, and the line of one import per edge."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    lines: dict[tuple[str, str], int] = {}
    for name, path in modules.items():
        for target, imported, line in imports_of(name, path.read_text(encoding="utf-8"),
                                                 is_package=path.name == "__init__.py"):
            if imported is not None and f"{target}.{imported}" in modules:
                dependency = f"{target}.{imported}"
            elif target in modules:
                dependency = target
            else:
                continue  # outside the package
            if dependency != name:
                graph[name].add(dependency)
                lines.setdefault((name, dependency), line)
    return graph, lines


# -- circles ----------------------------------------------------------------------------------------


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    nodes = set(graph) | {w for targets in graph.values() for w in targets}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of two or more modules, and modules that
    import themselves."""
    return sorted(
        c for c in strongly_connected(graph) if len(c) > 1 or c[0] in set(graph.get(c[0], ()))
    )


def describe_circle(component: list[str], graph: Mapping[str, Iterable[str]],
                    lines: Mapping[tuple[str, str], int]) -> str:
    members = set(component)
    edges = [
        f"    {a} -> {b} (line {lines.get((a, b), '?')})"
        for a in component
        for b in sorted(graph.get(a, ()))
        if b in members
    ]
    return f"  circle of {len(component)}: {', '.join(component)}\n" + "\n".join(edges)


# -- the package ------------------------------------------------------------------------------------


def test_no_import_circles_in_the_package() -> None:
    graph, lines = import_graph(ROOT, PACKAGE)
    assert len(graph) > 50, f"found only {len(graph)} modules under {ROOT / PACKAGE}"
    found = circles(graph)
    assert not found, (
        f"{len(found)} import circle(s) among {PACKAGE}/ modules (function-level imports count; move the "
        "shared contract into a module both import, or put annotation-only imports under "
        "`if TYPE_CHECKING:`):\n" + "\n".join(describe_circle(c, graph, lines) for c in found)
    )


def plugin_packages() -> set[str]:
    """Names under which the built-in plugins can be imported: the distribution's packages that do
    not live in ``elasticfw/`` (``[tool.setuptools] package-dir``), and the folders they live in."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir = config["tool"]["setuptools"]["package-dir"]
    names = {name for name, folder in package_dir.items() if folder != PACKAGE}
    names |= {folder.split("/")[0] for name, folder in package_dir.items() if folder != PACKAGE}
    for target in config["project"]["entry-points"]["elasticfw"].values():
        names.add(re.split(r"[.:]", target)[0])
    return names


def test_the_core_never_imports_the_plugins() -> None:
    forbidden = plugin_packages()
    assert {"elasticfw_plugins", "plugins"} <= forbidden, forbidden
    offenders = []
    for name, path in module_names(ROOT, PACKAGE).items():
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        every = [  # TYPE_CHECKING imports included: not even for annotations
            (node.module or "", node.lineno) if isinstance(node, ast.ImportFrom) else (alias.name, node.lineno)
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0)
            for alias in node.names
        ]
        offenders += [f"{name} (line {line}): {target}" for target, line in every
                      if target.split(".")[0] in forbidden]
    assert not offenders, "elasticfw/ must not import the built-in plugins:\n" + "\n".join(sorted(set(offenders)))


# -- the checker itself -----------------------------------------------------------------------------


def test_the_circle_finder_on_a_hand_built_graph() -> None:
    graph = {
        "a": {"b"}, "b": {"c"}, "c": {"a", "d"},  # a circle of three
        "d": {"e"}, "e": set(),                   # a chain: no circle
        "f": {"g"}, "g": {"f"},                   # a circle of two
        "h": {"h"},                               # a module importing itself
        "i": {"a"},                               # leads into a circle without being in it
    }
    assert circles(graph) == [["a", "b", "c"], ["f", "g"], ["h"]]
    assert circles({"x": {"y"}, "y": set()}) == []
    components = strongly_connected(graph)
    assert sorted(m for c in components for m in c) == sorted(graph)  # a partition of the nodes


def test_the_circle_finder_on_a_long_chain() -> None:
    """Deep graphs do not hit the recursion limit (the finder is iterative)."""
    n = 5 * sys.getrecursionlimit()
    chain = {f"m{i}": {f"m{i + 1}"} for i in range(n)}
    assert circles(chain) == []
    chain[f"m{n}"] = {"m0"}
    (found,) = circles(chain)
    assert len(found) == n + 1


def test_the_graph_sees_function_level_and_relative_imports_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .inner import thing\n")
    (pkg / "base.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.top import Top\n"  # annotations only: not an edge
        "else:\n"
        "    import json\n"
    )
    (pkg / "top.py").write_text("import os\nfrom pkg.base import X\n")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n    return g\n")  # hidden in a function
    (pkg / "high.py").write_text("from . import low\n")  # relative, a submodule by name
    (pkg / "sub" / "inner.py").write_text("from .. import base\nfrom ..sub import inner as again\n")
    graph, lines = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": set(),
        "pkg.sub": {"pkg.sub.inner"},
        "pkg.base": set(),
        "pkg.top": {"pkg.base"},
        "pkg.low": {"pkg.high"},
        "pkg.high": {"pkg.low"},
        "pkg.sub.inner": {"pkg.base"},  # ..sub.inner is itself: no edge
    }
    assert lines[("pkg.low", "pkg.high")] == 2
    found = circles(graph)
    assert found == [["pkg.high", "pkg.low"]]
    text = describe_circle(found[0], graph, lines)
    assert "pkg.low -> pkg.high (line 2)" in text and "pkg.high -> pkg.low (line 1)" in text
