"""One vocabulary: stage, FSDP phase, collective, memory-category, family (fsdp2 / fsdp1 / ddp), ZeRO-stage and
what-if replay-role names, and the comm-kernel test (the "nccl" / "rccl" prefixes), are written once, in
fsdpprof/analyze/model/ (the run-directory format's in runfmt.py); everywhere else in fsdpprof/ the code
uses the names (``model.STAGE_FORWARD``, ``model.ALL_GATHER``, ``MemoryCategory.ACTIVATION``), so that a
reader finds each concept in one place and a rename cannot miss a copy."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from fsdpprof.analyze import model

ROOT = Path(__file__).resolve().parent.parent / "fsdpprof"
VOCABULARY = {
    "stage": model.STAGES,
    "FSDP phase": model.FSDP_PHASES,
    "collective": model.COLLECTIVES,
    "memory category": [c.value for c in model.MemoryCategory],
    "family": list(model.FAMILIES),
    "ZeRO stage": [model.ZERO_1, model.ZERO_2, model.ZERO_3],
    "comm-kernel test": sorted(set(model.COMM_KERNEL_LIBRARIES) | set(model.COMM_KERNEL_PREFIXES)),
    "what-if replay role": [r.value for r in model.ReplayRole],
}
# where the names are defined: the vocabulary package and the run-directory format
DEFINED_IN = ("analyze/model/", "runfmt.py")
# (file under fsdpprof/, text) -> (how many times, why that string is not the concept there)
_OPTIMIZER_KEY = "the optimizer itself (inventory.json / summary.json field, option), not the optimizer stage"
NOT_THE_CONCEPT = {
    ("analyze/comm/breakdown.py", "other"): (1, "HTA's idle-time category 'other', not a memory category"),
    ("analyze/memory/categorize.py", "backward"): (1, "a substring of C++ autograd function names in stack frames"),
    ("analyze/memory/oom.py", "unknown"): (1, "the word a sentence says for a missing size"),
    ("collect/launcher.py", "unknown"): (1, "the word shown for a run.json without a status"),
    ("report/figures.py", "data"): (5, "plotly's figure field 'data'"),
    ("report/compare_page.py", "data"): (1, "plotly's error-bar type 'data'"),
    ("report/overview.py", "input"): (1, "the Overview table's row naming the input path"),
    ("report/timeline.py", "input"): (1, "the timeline file's field naming the input path"),
    ("analyze/summary/theory.py", "param"): (1, "a spelling of --offload params"),
    ("analyze/summary/theory.py", "optimizer"): (4, "--offload optimizer, and " + _OPTIMIZER_KEY),
    ("analyze/summary/model_states.py", "optimizer"): (1, _OPTIMIZER_KEY),
    ("analyze/pipeline.py", "optimizer"): (2, _OPTIMIZER_KEY),
    ("collect/inventory.py", "optimizer"): (1, _OPTIMIZER_KEY),
    ("commands/plan.py", "optimizer"): (3, _OPTIMIZER_KEY),
    ("report/overview.py", "optimizer"): (4, _OPTIMIZER_KEY),
    ("examples/train_fsdp.py", "fsdp2"): (2, "the example's --strategy choices (a CLI name, not the family)"),
    ("examples/train_fsdp.py", "fsdp1"): (1, "the example's --strategy choices (a CLI name, not the family)"),
    ("examples/train_fsdp.py", "ddp"): (3, "the example's --strategy choices (a CLI name, not the family)"),
    ("examples/train_fsdp.py", "nccl"): (1, "torch.distributed's backend name"),
    ("commands/demo.py", "fsdp2"): (2, "the example's --strategy names the demo records"),
    ("commands/demo.py", "ddp"): (1, "the example's --strategy names the demo records"),
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
                out.update(id(c) for c in ast.walk(node) if isinstance(c, ast.Constant))
    return out


def _concepts() -> dict[str, str]:
    concept_of: dict[str, str] = {}
    for concept, names in VOCABULARY.items():
        for n in names:
            concept_of[n] = f"{concept_of[n]} / {concept}" if n in concept_of else concept
    return concept_of


def literals_in(source: str, rel: str = "<text>") -> list[tuple[str, int, str, str]]:
    """(file, line, text, concept) of every string literal of ``source`` that is a vocabulary name."""
    concept_of = _concepts()
    tree = ast.parse(source)
    skip = _skipped(tree)
    return [(rel, node.lineno, node.value, concept_of[node.value]) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and type(node.value) is str and node.value in concept_of
            and id(node) not in skip]


@functools.cache
def vocabulary_literals() -> list[tuple[str, int, str, str]]:
    """(file, line, text, concept) of every string literal in fsdpprof/ outside the vocabulary that is a
    vocabulary name."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(DEFINED_IN):
            found += literals_in(path.read_text(encoding="utf-8"), rel)
    return found


def _counts(found) -> dict:
    out: dict = {}
    for rel, _, text, _ in found:
        out[(rel, text)] = out.get((rel, text), 0) + 1
    return out


def test_vocabulary_names_are_written_once():
    found = vocabulary_literals()
    allowed = {key for key, n in _counts(found).items() if NOT_THE_CONCEPT.get(key, (0,))[0] == n}
    found = [f for f in found if (f[0], f[2]) not in allowed]
    assert not found, (f"{len(found)} vocabulary name(s) written as a string outside fsdpprof/analyze/model/: use "
                       f"the name there instead:\n" + "\n".join(f"  fsdpprof/{f}:{line}: {text!r} ({concept})"
                                                                for f, line, text, concept in found))


def test_the_scan_finds_a_copy(tmp_path):
    """The scan flags a copied name (and skips a docstring and an f-string that mention one)."""
    tree = ast.parse('"""all_gather in a docstring"""\nx = f"{y} forward"\nif stage == "backward": pass\n')
    skip = _skipped(tree)
    consts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in skip]
    assert consts == ["backward"]


def test_the_scan_finds_a_family_a_zero_stage_a_comm_kernel_test_and_a_replay_role():
    """A family, a ZeRO stage, a comm-kernel test or a what-if replay role written as a literal is flagged."""
    src = ('fsdp = kind in ("fsdp2", "fsdp1")\nif stage == "ZERO2": pass\n'
           'nccl = names.str.lower().str.startswith(("nccl", "rccl"))\nheld = role == "ag_held"\n')
    assert sorted((text, concept) for _, _, text, concept in literals_in(src)) == sorted([
        ("fsdp2", "family"), ("fsdp1", "family"), ("ZERO2", "ZeRO stage"), ("nccl", "comm-kernel test"),
        ("rccl", "comm-kernel test"), ("ag_held", "what-if replay role")])


def test_one_comm_kernel_test_for_a_name_and_an_array():
    """model.is_comm_kernel: one rule for a name and for an array of names (NCCL / RCCL, any case)."""
    import numpy as np

    names = ["ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", "rccl_allreduce", "NCCLKERNEL_x", "void gemm", None]
    assert model.is_comm_kernel(names[0]) and not model.is_comm_kernel("void gemm")
    assert model.is_comm_kernel(np.array(names, dtype=object)).tolist() == [True, True, True, False, False]


def test_allowed_exceptions_are_exact():
    """Each allowed exception has a reason and counts exactly the strings that are there: one more copy of the
    word in that file fails the scan, one fewer makes the entry stale."""
    counts = _counts(vocabulary_literals())
    for key, (n, why) in NOT_THE_CONCEPT.items():
        assert why and counts.get(key) == n, (key, counts.get(key), n)


def test_one_description_of_an_input():
    """Every command describes an input with model.describe_input: the strategy, the framework, the ranks."""
    d = model.describe_input
    assert d("fsdp2", "FULL_SHARD", 8) == "FULL_SHARD, FSDP2, 8 ranks"
    assert d("ddp", None, 16) == d("ddp", "DDP", 16) == "DDP, 16 ranks"          # traces where DDP ran; inventory
    assert d("fsdp1", None, 4) == "FSDP1, 4 ranks" and d("single_device", "NONE", 1) == "one device"
    assert d(model.input_kind("none", (), 1), "NONE", 1) == "one device"          # inventory.json of one device
    assert d("unknown", None, None) == "unknown input, world size unknown"


def test_one_strategy_table():
    """One alias table: theory's ZeRO stage and what-if's strategy come from the same spelling."""
    from fsdpprof.analyze.summary import theory
    from fsdpprof.errors import UserError

    for spelling, strategy, stage in (("full_shard", "FULL_SHARD", "ZERO3"), ("ZeRO-2", "SHARD_GRAD_OP", "ZERO2"),
                                      ("no_shard", "NO_SHARD", "DDP"), ("HSDP", "HYBRID_SHARD", "HYBRID_SHARD"),
                                      ("zero 1", "ZERO1", "ZERO1")):
        assert model.strategy_name(spelling) == strategy and model.zero_stage(spelling) == stage
        assert theory.traffic_per_step(1e9, spelling, 8).strategy == stage
    assert theory.strategy_from_inventory({"strategy": "NO_SHARD"}) == "DDP"
    with pytest.raises(UserError, match="use one of DDP, NO_SHARD, SHARD_GRAD_OP"):
        model.strategy_name("ZERO1", model.STANDARD)      # what-if predicts the FSDP / DDP strategies only
    with pytest.raises(UserError, match="unknown dtype 'int3'"):
        model.dtype_bytes("int3")                          # one policy: no size is guessed


def test_units_in_one_order():
    assert model.unit_order(["b", "a", "(root)", "layers.10", "layers.2"], forward=["b", "a"]) == \
        ["(root)", "b", "a", "layers.2", "layers.10"]
