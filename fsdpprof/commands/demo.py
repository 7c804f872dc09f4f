"""``fsdpprof demo``: record the built-in example under several strategies on CPU and report on each.

The demo's model is sized so that the model states dominate the peak (a narrow, deep transformer, short sequence,
batch 1), so the runs show what the ZeRO formulas promise: model states per rank falling as 1/N from DDP to
FULL_SHARD on 2 and 4 ranks, the peak falling with them, FULL_SHARD moving 1.5x DDP's bytes."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

from fsdpprof import options, runfmt
from fsdpprof.commands import add
from fsdpprof.errors import UserError

# (strategy of the example, ranks): DDP, SHARD_GRAD_OP and FULL_SHARD on 2 ranks, FULL_SHARD and HSDP on 4
RUNS = (("ddp", 2), ("fsdp2-no-reshard", 2), ("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4))
RECORD_ARGS = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "2")
TRAIN_ARGS = ("--steps", "4")   # the recording window is steps 1-3: the trace is saved when step 3 ends
# Ψ = 3.66 M parameters (56 MiB of fp32 model states with AdamW under DDP), 8 blocks of 192 wide (9 FSDP units),
# 16 tokens, batch 1 (activations under 2 MiB); about 84 ms per DDP step on 2 CPU processes
MODEL_ARGS = ("--dim", "192", "--layers", "8", "--heads", "4", "--seq", "16", "--batch", "1", "--vocab", "256")
# the packaged example (installed with fsdpprof; the repository's examples/train_fsdp.py only runs this one)
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_fsdp.py")


def add_arguments(p) -> None:
    p.add_argument("--out", default="fsdpprof-demo", help="folder for the runs and reports (default ./fsdpprof-demo)")
    p.add_argument("--strategies", default=",".join(f"{s}:{n}" for s, n in RUNS),
                   help="comma-separated strategies of the example, each optionally with its number of processes "
                        f"as STRATEGY:N (default {','.join(f'{s}:{n}' for s, n in RUNS)})")
    p.add_argument("--nproc", type=options.DEMO_NPROC, default=2,
                   help=f"processes for a strategy given without :N (default 2, at most {options.MAX_DEMO_NPROC})")
    add(p, "--force", "--self-contained", force="overwrite report/compare files in --out that fsdpprof did not write")


def _previous_run(run_dir: str) -> bool:
    """True when ``run_dir`` holds an earlier fsdpprof run (re-recorded with ``record --force``); False when
    it is absent or an empty folder; UserError when something else is there (it is never removed)."""
    from fsdpprof.analyze.load.files import read_run_json

    if not os.path.lexists(run_dir):
        return False
    if os.path.isdir(run_dir) and not os.path.islink(run_dir):
        if not os.listdir(run_dir):
            return False
        run_json = os.path.join(run_dir, runfmt.RUN_JSON)
        if os.path.isfile(run_json) and read_run_json(run_json)[0] is not None:
            return True
    raise UserError(f"{run_dir} exists and is not an fsdpprof run: the demo records there; move it away "
                    f"or choose another --out")


def example_strategies() -> tuple[str, ...]:
    """The example's ``STRATEGIES``, read from its source (importing it would import torch)."""
    with open(EXAMPLE, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    return next(tuple(ast.literal_eval(node.value)) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "STRATEGIES" for t in node.targets))


def record_example(out_dir: str, strategy: str, nproc: int = 2, replace: bool = False) -> subprocess.CompletedProcess:
    """fsdpprof record -- torchrun (gloo, CPU) the packaged example at the demo's size with one strategy
    (``replace``: an earlier fsdpprof run in ``out_dir``, via ``record --force``)."""
    cmd = [sys.executable, "-m", "fsdpprof", "record", "--out", out_dir, *(["--force"] if replace else []),
           *RECORD_ARGS, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           EXAMPLE, "--strategy", strategy, *TRAIN_ARGS, *MODEL_ARGS, "--quiet"]
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def parse_runs(spec: str, nproc: int) -> list[tuple[str, int]]:
    """``--strategies``: comma-separated STRATEGY or STRATEGY:N (N processes; ``nproc`` without one)."""
    known = example_strategies()
    runs = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        s, sep, n = item.partition(":")
        s = s.strip()
        if s not in known:
            raise UserError(f"--strategies {s[:40]!r} is not a strategy of the example: use some of {','.join(known)}")
        k = options.DEMO_NPROC.parse(n, f"--strategies {item[:40]!r}: the processes after ':'") if sep else nproc
        if s in ("hsdp", "fsdp1-hybrid") and (k < 2 or k % 2):
            raise UserError(f"--strategies {item[:40]!r}: hybrid sharding needs an even number of processes, "
                            f"e.g. {s}:4")
        runs.append((s, k))
    if not runs:
        raise UserError("--strategies is empty: give e.g. fsdp2,ddp or fsdp2:2,fsdp2:4")
    if len(set(runs)) != len(runs):
        raise UserError("--strategies names a strategy twice with the same processes: give each once, e.g. fsdp2,ddp")
    return runs


def run(args) -> int:
    from fsdpprof.analyze.compare.runs import compare_analyses
    from fsdpprof.commands.compare import write_compare
    from fsdpprof.commands.report import analyse_path, write_report
    from fsdpprof.report.outputs import check_not_empty, check_outputs, plotly_output, plotly_path
    from fsdpprof.report.text import compare_text

    runs = parse_runs(args.strategies, args.nproc)
    # a run's folder and files: the strategy, with -Nranks when N is not --nproc
    names = [s if n == args.nproc else f"{s}-{n}ranks" for s, n in runs]
    check_not_empty(**{"--out": args.out})
    out = os.path.abspath(args.out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} exists and is not a folder: choose a folder for the demo's runs and reports")
    files = [f"{kind}-{name}.{ext}" for name in names for kind, ext in (("report", "html"), ("summary", "json"))]
    files += ["compare.html", "compare.json"] if len(runs) >= 2 else []
    outputs = [(os.path.join(out, f), "the demo's") for f in files]
    outputs += plotly_output(os.path.join(out, "compare.html"), args.self_contained)   # (one for the folder)
    check_outputs(outputs, force=args.force, fix="choose another --out")
    previous = {name: _previous_run(os.path.join(out, f"run-{name}")) for name in names}
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out}: {exc.strerror}; choose a writable folder") from None
    analyses, written = [], []
    t_start = time.time()
    for (s, n), name in zip(runs, names):
        run_dir = os.path.join(out, f"run-{name}")
        t0 = time.time()
        print(f"demo: recording the example with --strategy {s} on {n} CPU process{'es' if n != 1 else ''} (gloo) ...",
              flush=True)
        proc = record_example(run_dir, s, n, replace=previous[name])
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
            raise UserError(f"recording strategy {s} on {n} processes failed (exit {proc.returncode}): "
                            f"{' | '.join(tail)}; see {run_dir}")
        analyses.append(analyse_path(run_dir, hta=False, ops=True))   # (compared below)
        written += write_report(analyses[-1], os.path.join(out, f"report-{name}.html"),
                                os.path.join(out, f"summary-{name}.json"), self_contained=args.self_contained)
        print(f"demo: {s} on {n} recorded and reported in {time.time() - t0:.0f} s", flush=True)
    if len(analyses) >= 2:
        c = compare_analyses(analyses, allow_different_models=True)
        written += write_compare(c, os.path.join(out, "compare.html"), os.path.join(out, "compare.json"),
                                 self_contained=args.self_contained)
        print(compare_text(c))
    js = plotly_path(os.path.join(out, "compare.html"))
    if not args.self_contained and os.path.isfile(js):
        written.append(js)      # (the pages' plotly.js, written once for the folder)
    print(f"demo: wrote (in {time.time() - t_start:.0f} s)")
    for p in written:
        print(f"  {p}")
    return 0
