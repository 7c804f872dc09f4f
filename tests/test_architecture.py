"""The shape of the code: fsdpprof's modules import each other without a cycle, at module top (a few lazy
imports where start-up must stay light), and the commands that answer at once import no heavy library.

The import graph is built from the source with ``ast`` (nothing is imported): a node per module of fsdpprof/,
an edge per import of another fsdpprof module, wherever the import statement is (module top or inside a
function), ``from pkg import name`` naming the submodule when ``name`` is one.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdpprof"

# function-local imports of fsdpprof modules allowed outside the CLI boundary (cli.py, commands/): the ones that
# keep collect light inside the user's job (fsdpprof.record, the bootstrap, the recorder), the finding of a
# run's files light (a bad path is refused before numpy and pandas are imported), and report.outputs light
LOCAL_IMPORTS_MAX = 10
BOUNDARY = ("fsdpprof.cli", "fsdpprof.commands")
HEAVY = {"pandas", "numpy", "torch", "plotly"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of fsdpprof/ (a package is its __init__.py)."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _top_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the import statements that run when the module is imported (module body, its if / try blocks)."""
    out: set[int] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.add(id(node))
        elif isinstance(node, (ast.If, ast.Try)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return out


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(module -> the fsdpprof modules it imports, anywhere in it; function-local imports as (module, line,
    imported module))."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    local: list[tuple[str, int, str]] = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top = _top_level_nodes(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            targets = {resolve(n) for n in names if n.split(".")[0] == "fsdpprof"} - {None, module}
            edges[module] |= targets
            if id(node) not in top:
                local += [(module, node.lineno, t) for t in sorted(targets)]
    return edges, local


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_one_cycle(edges, set(c)) for c in components]


def _one_cycle(edges: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, within the component."""
    start = min(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(edges[v] & comp):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return sorted(comp)


def test_the_graph_sees_imports_of_every_form():
    """The graph itself: a plain, a from-, a relative and a function-local import are all edges (else the two
    tests below would pass on a graph that misses them)."""
    edges, local = import_graph()
    assert "fsdpprof.analyze.pipeline" in edges["fsdpprof.commands.report"]           # local, in run()
    assert ("fsdpprof.commands.report" in {m for m, _, _ in local})
    assert "fsdpprof.analyze.load.engines" in edges["fsdpprof.analyze.load.run"]      # from pkg import module
    assert "fsdpprof.errors" in edges["fsdpprof.analyze.load.files"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle():
    edges, _ = import_graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_at_module_top():
    """Lazy (function-local) imports of fsdpprof modules only at the CLI boundary, and at most
    LOCAL_IMPORTS_MAX elsewhere: an import inside a function hides the call graph from a reader."""
    _, local = import_graph()
    inner = sorted({(m, line, t) for m, line, t in local if not m.startswith(BOUNDARY)})
    listed = "\n".join(f"  {m}:{line} imports {t}" for m, line, t in inner)
    assert len(inner) <= LOCAL_IMPORTS_MAX, f"{len(inner)} function-local imports of fsdpprof modules:\n{listed}"


def _imported_by(*argv: str) -> set[str]:
    """Top-level packages a fresh ``python -m fsdpprof ARGV`` imports (``-X importtime``)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "fsdpprof", *argv], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return {x.split("|")[-1].strip().split(".")[0] for x in p.stderr.splitlines() if x.startswith("import time:")}


def test_help_and_plan_import_no_heavy_library():
    """``fsdpprof --help`` and ``fsdpprof plan`` answer at once: neither pandas, numpy, torch nor plotly."""
    for argv in (["--help"], ["plan", "--params", "7B", "--world", "8"]):
        imported = _imported_by(*argv)
        assert "fsdpprof" in imported and not imported & HEAVY, (argv, sorted(imported & HEAVY))
