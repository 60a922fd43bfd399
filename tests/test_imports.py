"""The import graph of src/redeqx has no cycles (issue 21): every module can be
read knowing only what it imports, and `import redeqx, redeqx.models` imports
no module twice through a circle. Imports inside functions count too: a lazy
import that closes a circle only hides it."""

import ast
from pathlib import Path

import redeqx

SRC = Path(redeqx.__file__).resolve().parent


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The redeqx modules ``path`` imports, anywhere in the file."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "redeqx")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "redeqx":
                continue
            for alias in node.names:  # `from . import x` imports the submodule x, when there is one
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


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
