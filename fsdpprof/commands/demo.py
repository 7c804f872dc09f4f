"""``fsdpprof demo``: record the built-in example under several strategies on CPU and report on each."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from fsdpprof.errors import UserError

STRATEGIES = ("fsdp2", "fsdp2-no-reshard", "ddp")
RECORD_ARGS = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "2")
TRAIN_ARGS = ("--steps", "5")


def add_arguments(p) -> None:
    p.add_argument("--out", default="fsdpprof-demo", help="folder for the runs and reports (default ./fsdpprof-demo)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated strategies of the example (default {','.join(STRATEGIES)})")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")


def record_example(out_dir: str, strategy: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """fsdpprof record -- torchrun (gloo, CPU) the packaged example with one strategy."""
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "examples", "train_fsdp.py")
    cmd = [sys.executable, "-m", "fsdpprof", "record", "--out", out_dir, *RECORD_ARGS, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           example, "--strategy", strategy, *TRAIN_ARGS, "--quiet"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def run(args) -> int:
    from fsdpprof.analyze.pipeline import compare_analyses
    from fsdpprof.commands.compare import write_compare
    from fsdpprof.commands.report import analyse_path, write_report
    from fsdpprof.report.text import compare_text

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        raise UserError("--strategies is empty: give e.g. fsdp2,ddp")
    if args.nproc < 1:
        raise UserError("--nproc must be at least 1")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    analyses, written = [], []
    for s in strategies:
        run_dir = os.path.join(out, f"run-{s}")
        if os.path.exists(run_dir):
            import shutil

            shutil.rmtree(run_dir)
        t0 = time.time()
        print(f"demo: recording the example with --strategy {s} on {args.nproc} CPU processes (gloo) ...", flush=True)
        proc = record_example(run_dir, s, args.nproc)
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
