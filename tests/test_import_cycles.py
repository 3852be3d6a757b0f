"""No import cycles inside pagellm/, function-level imports included (they hide a cycle, they do not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "pagellm"


def import_graph() -> dict[str, set[str]]:
    """module -> the pagellm modules it imports anywhere in its file."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_pagellm_has_no_import_cycles():
    graph = import_graph()
    assert "pagellm.engine" in graph and "pagellm.platform" in graph["pagellm.engine"]
    assert cycles(graph) == []


# The model side (kernels, layers, models, core) sits below the step's driver: it is handed what it needs
# (AttentionMetadata lives in core/ for that reason) and imports only itself and these plain-data modules.
LOWER = ("pagellm.kernels", "pagellm.layers", "pagellm.models", "pagellm.core")
BELOW_ALL = ("pagellm.config", "pagellm.request", "pagellm.sampling_params", "pagellm.platform")


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_model_side_never_imports_the_layers_that_drive_it():
    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if _in(m, LOWER)
                    for t in targets if not _in(t, LOWER + BELOW_ALL))
    assert upward == []
