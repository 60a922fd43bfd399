"""The import graph of src/redeqx has no cycles (issue 21): every module can be
read knowing only what it imports, and `import redeqx, redeqx.models` imports
no module twice through a circle. Imports inside functions count too: a lazy
import that closes a circle only hides it."""

from pathlib import Path

from test_layout import SRC, _imports as layout_imports, _module


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The redeqx modules ``path`` imports, anywhere in the file (read as the layering test reads them)."""
    return {m for m, _ in layout_imports(path) if m in modules and m != _module(path)}


def test_the_import_graph_has_no_cycles():
    files = sorted(SRC.rglob("*.py"))
    modules = {_module(f) for f in files}
    graph = {_module(f): _imports(f, modules) for f in files}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "redeqx.models" in graph and graph["redeqx"], "the graph was not read"
