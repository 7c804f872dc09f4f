"""``fsdpprof demo``: record the built-in example under several strategies on CPU and report on each."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

from fsdpprof.errors import UserError

STRATEGIES = ("fsdp2", "fsdp2-no-reshard", "ddp")
RECORD_ARGS = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "2")
TRAIN_ARGS = ("--steps", "5")
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "train_fsdp.py")


def add_arguments(p) -> None:
    p.add_argument("--out", default="fsdpprof-demo", help="folder for the runs and reports (default ./fsdpprof-demo)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated strategies of the example (default {','.join(STRATEGIES)})")
    p.add_argument("--nproc", type=int, default=2, help=f"processes per run (default 2, at most {MAX_NPROC})")
    p.add_argument("--force", action="store_true",
                   help="overwrite report/compare files in --out that fsdpprof did not write")


MAX_NPROC = 16  # CPU processes per recording (gloo); more only slows the demo down


def _previous_run(run_dir: str) -> bool:
    """True when ``run_dir`` holds an earlier fsdpprof run (re-recorded with ``record --force``); False when
    it is absent or an empty folder; UserError when something else is there (it is never removed)."""
    from fsdpprof import runfmt
    from fsdpprof.analyze.run import read_run_json

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
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "STRATEGIES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return STRATEGIES


def record_example(out_dir: str, strategy: str, nproc: int = 2, replace: bool = False) -> subprocess.CompletedProcess:
    """fsdpprof record -- torchrun (gloo, CPU) the packaged example with one strategy (``replace``: an earlier
    fsdpprof run in ``out_dir``, via ``record --force``)."""
    cmd = [sys.executable, "-m", "fsdpprof", "record", "--out", out_dir, *(["--force"] if replace else []),
           *RECORD_ARGS, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           EXAMPLE, "--strategy", strategy, *TRAIN_ARGS, "--quiet"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def run(args) -> int:
    from fsdpprof.analyze.compare import compare_analyses
    from fsdpprof.commands.compare import write_compare
    from fsdpprof.commands.report import analyse_path, write_report
    from fsdpprof.report.outputs import check_not_empty, check_outputs
    from fsdpprof.report.text import compare_text

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        raise UserError("--strategies is empty: give e.g. fsdp2,ddp")
    known = example_strategies()
    bad = [s for s in strategies if s not in known]
    if bad:
        raise UserError(f"--strategies {bad[0][:40]!r} is not a strategy of the example: use some of {','.join(known)}")
    if len(set(strategies)) != len(strategies):
        raise UserError("--strategies names a strategy twice: give each once, e.g. fsdp2,ddp")
    if not 1 <= args.nproc <= MAX_NPROC:
        raise UserError(f"--nproc {args.nproc} must be between 1 and {MAX_NPROC}")
    check_not_empty(**{"--out": args.out})
    out = os.path.abspath(args.out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} exists and is not a folder: choose a folder for the demo's runs and reports")
    outputs = [(os.path.join(out, name), "the demo's") for s in strategies
               for name in (f"report-{s}.html", f"summary-{s}.json")]
    if len(strategies) >= 2:
        outputs += [(os.path.join(out, "compare.html"), "the demo's"), (os.path.join(out, "compare.json"), "the demo's")]
    check_outputs(outputs, force=args.force, fix="choose another --out")
    previous = {s: _previous_run(os.path.join(out, f"run-{s}")) for s in strategies}
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out}: {exc.strerror}; choose a writable folder") from None
    analyses, written = [], []
    for s in strategies:
        run_dir = os.path.join(out, f"run-{s}")
        t0 = time.time()
        print(f"demo: recording the example with --strategy {s} on {args.nproc} CPU processes (gloo) ...", flush=True)
        proc = record_example(run_dir, s, args.nproc, replace=previous[s])
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
            raise UserError(f"recording strategy {s} failed (exit {proc.returncode}): {' | '.join(tail)}; "
                            f"see {run_dir}")
        a = analyse_path(run_dir, hta=False)
        html_path, summary_path = write_report(a, os.path.join(out, f"report-{s}.html"),
                                               os.path.join(out, f"summary-{s}.json"))
        analyses.append(a)
        written += [html_path, summary_path]
        print(f"demo: {s} recorded and reported in {time.time() - t0:.0f} s", flush=True)
    if len(analyses) >= 2:
        c = compare_analyses(analyses, allow_different_models=True)
        ch, cj = write_compare(c, os.path.join(out, "compare.html"), os.path.join(out, "compare.json"))
        written += [ch, cj]
        print(compare_text(c))
    print("demo: wrote")
    for p in written:
        print(f"  {p}")
    return 0
