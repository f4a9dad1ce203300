"""The library's shape, read from the source with `ast` (imports no project module; ~1 s).

- No import circle among `jaxrl/` and `msd_jax/` modules. Every import statement counts: module
  level, inside functions, and under `if TYPE_CHECKING:`; a circle that only shows at run time
  (a function-level import) or only to the type checker is still two modules that cannot be read,
  tested or moved apart.
- No `from X import _name` in `jaxrl/`, `msd_jax/`, `launch/`, `bench/` where X is one of their
  modules: a helper two modules share is public (tests may still reach into private helpers).
- No module in `jaxrl/`, `msd_jax/`, `launch/` over 600 lines (STYLE.md habit 9).
- No module at the top of `jaxrl/` but its `__init__.py`: each lives in the package of its part of
  the flow (`jaxrl/train/`, `jaxrl/loop/`, ...); old top-level paths are aliases without files
  (`jaxrl/infra/moved_modules.py`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPH_PACKAGES = ("jaxrl", "msd_jax")
PROJECT_PACKAGES = ("jaxrl", "msd_jax", "launch", "bench")
SIZE_PACKAGES = ("jaxrl", "msd_jax", "launch")
MAX_LINES = 600


def _module_files(packages):
    """{dotted module name: path} for every .py file under the given top-level packages."""
    modules = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imports(name, path):
    """(target, imported names, line) of each import statement in a file (relative ones resolved).

    `from X import a, b` gives (X, [a, b]); `import X.Y` gives (X.Y, []).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((target, [alias.name for alias in node.names], node.lineno))
    return found


def _import_graph(modules):
    """{module: {imported project module: first line}}; `from pkg import mod` points at pkg.mod."""
    graph = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, names, line in _imports(name, path):
            targets = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            if len(targets) < len(names) or not names:
                targets.append(target)
            for t in targets:
                if t in modules and t != name:
                    edges.setdefault(t, line)
    return graph


def _find_cycle(graph):
    """One import circle as [a, b, ..., a], or None (iterative depth-first search)."""
    state = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_circle():
    modules = _module_files(GRAPH_PACKAGES)
    graph = _import_graph(modules)
    cycle = _find_cycle(graph)
    if cycle:
        steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import circle:\n  " + "\n  ".join(steps))


def test_no_private_name_imported_across_modules():
    modules = _module_files(PROJECT_PACKAGES)
    offenders = []
    for name, path in modules.items():
        for target, names, line in _imports(name, path):
            if target.split(".")[0] not in PROJECT_PACKAGES:
                continue
            for imported in names:
                if imported.startswith("_") and not imported.startswith("__"):
                    offenders.append(
                        f"{path.relative_to(ROOT)}:{line}: from {target} import {imported}"
                    )
    assert not offenders, "private names imported across modules:\n  " + "\n  ".join(offenders)


def test_no_module_over_the_size_limit():
    offenders = []
    for path in _module_files(SIZE_PACKAGES).values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            offenders.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not offenders, f"modules over {MAX_LINES} lines:\n  " + "\n  ".join(offenders)


def test_no_module_at_the_top_of_jaxrl():
    top = sorted(p.name for p in (ROOT / "jaxrl").glob("*.py") if p.name != "__init__.py")
    assert not top, (
        f"modules at the top of jaxrl/: {top}; put each in the package of its part of the flow "
        "(a moved module's old path goes in jaxrl/infra/moved_modules.py)"
    )


def test_the_cycle_finder_finds_a_circle():
    assert _find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) is None
