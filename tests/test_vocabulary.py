"""One vocabulary: stage, FSDP phase, collective and memory-category names are written once, in
fsdpprof/analyze/model/ (the run-directory format's in runfmt.py); everywhere else in fsdpprof/ the code
uses the names (``model.STAGE_FORWARD``, ``model.ALL_GATHER``, ``MemoryCategory.ACTIVATION``), so that a
reader finds each concept in one place and a rename cannot miss a copy."""
from __future__ import annotations

import ast
from pathlib import Path

from fsdpprof.analyze import model

ROOT = Path(__file__).resolve().parent.parent / "fsdpprof"
VOCABULARY = {
    "stage": model.STAGES,
    "FSDP phase": model.FSDP_PHASES,
    "collective": model.COLLECTIVES,
    "memory category": [c.value for c in model.MemoryCategory],
}
# where the names are defined: the vocabulary package and the run-directory format
DEFINED_IN = ("analyze/model/", "runfmt.py")
# (file under fsdpprof/, text) -> why that string is not the concept
NOT_THE_CONCEPT = {
}
# calls whose string arguments name other things (options, loggers)
_NAMING_CALLS = {"add_argument", "add_parser", "add_argument_group", "getLogger", "getattr", "hasattr"}


def _skipped(tree: ast.AST) -> set[int]:
    """ids of the str constants that are not code's values: docstrings, f-string fragments, the names an
    argparse / logging / attribute call takes."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        elif isinstance(node, ast.JoinedStr):
            out.update(id(v) for v in node.values)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _NAMING_CALLS:
                out.update(id(a) for a in node.args if isinstance(a, ast.Constant))
                out.update(id(k.value) for k in node.keywords if isinstance(k.value, ast.Constant))
    return out


def vocabulary_literals() -> list[tuple[str, int, str, str]]:
    """(file, line, text, concept) of every string literal in fsdpprof/ outside the vocabulary that is a
    vocabulary name."""
    concept_of = {}
    for concept, names in VOCABULARY.items():
        for n in names:
            concept_of.setdefault(n, concept)
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(DEFINED_IN):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _skipped(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and type(node.value) is str and node.value in concept_of
                    and id(node) not in skip and (rel, node.value) not in NOT_THE_CONCEPT):
                found.append((rel, node.lineno, node.value, concept_of[node.value]))
    return found


def test_vocabulary_names_are_written_once():
    found = vocabulary_literals()
    assert not found, (f"{len(found)} vocabulary name(s) written as a string outside fsdpprof/analyze/model/: use "
                       f"the name there instead:\n" + "\n".join(f"  fsdpprof/{f}:{line}: {text!r} ({concept})"
                                                                for f, line, text, concept in found))


def test_the_scan_finds_a_copy(tmp_path):
    """The scan flags a copied name (and skips a docstring and an f-string that mention one)."""
    tree = ast.parse('"""all_gather in a docstring"""\nx = f"{y} forward"\nif stage == "backward": pass\n')
    skip = _skipped(tree)
    consts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in skip]
    assert consts == ["backward"]


def test_allowed_exceptions_are_still_there():
    """Every allowed exception names a file and a string that still exist (no stale entries)."""
    for (rel, text), why in NOT_THE_CONCEPT.items():
        assert why and repr(text) in (ROOT / rel).read_text(encoding="utf-8").replace('"', "'"), (rel, text)
