"""Benchmark: `fsdpprof whatif` against real runs, every strategy predicted from every other.

    python benchmarks/bench_whatif.py [--repeats 10] [--out DIR] [--reuse DIR [DIR ...]] [--strategies a,b,...]

Records the example (fsdpprof/examples/train_fsdp.py) under each of its strategies with
`fsdpprof record` (2 ranks; 4 for HSDP and FSDP1 HYBRID_SHARD; gloo on CPU), ``--repeats`` times, in
turn (a, b, c, a, b, c ...) so that load on a shared machine falls on every strategy alike. Then, for
every pair (run of strategy S, strategy T), predicts T from S's recording (the target T is read from
T's own inventory: strategy, world size, shard group, offload) and prints two matrices, rows = the run
predicted from, columns = the strategy predicted:

- peak memory: 100 x (predicted / measured - 1) %, measured = the largest rank's peak of T's run;
- step time: predicted / measured, measured = the median step time of T's run (ranks x steps), all
  recorded in this invocation.

Each cell is the median over the repeats of S and T. Goals (issue 10): |peak error| <= 10 % for every pair,
step time within 20 % (ratio 0.8 .. 1.2). No assertion: the figures are printed. Ten repeats by default (90
recordings, about 20 minutes on 2 cores): on this 2-core machine one configuration's step time moves by up
to 1.9x between recordings minutes apart (FSDP2 without reshard: 132-256 ms), and a median of 5 carries that
noise into the matrix: one strategy's measured median low or high puts its whole column high or low. Two
disjoint halves of one 10-repeat invocation (2026-12-01, every one of the 252 splits) gave medians of the
same strategy 0.80-1.25x apart (FSDP2 with CPU offload; 43 % of the splits beyond 10 %), so 5 repeats cannot
judge a 20 % goal. With the fit of 2026-12-01 (latency at most the fastest call of its type on any rank):
75-80/81 pairs within 20 % over four sets of 3-5 repeats, 77-81/81 from three invocations of
``--repeats 10`` (one measured strategy's median still moves its column by up to 15 %), 81/81 from each of
three pools of 10-13 (a 2-core Xeon). On a 2-core AMD EPYC, where FSDP's own CPU work takes 2-3.5x as long
(2026-12-01, 8 repeats, about 21 minutes): 66/81 with the Xeon's documented figures, 80/81 with figures scaled
to the run's machine (timing.machine_factor) on a set not used to measure them; with gloo's reduce-scatter timed
as the all-reduce it runs (model.wire_factor; 2026-12-02), 81/81 on that set, on the two sets before it (81/81
of 8 repeats, 16/16 of 4 strategies x 6) and on a fresh one (81/81, worst x1.17; 78/81, worst x1.27, before).
``--reuse`` predicts from recordings made before, and pools those of several ``--out`` folders (every
``<strategy>-<n>`` in each). ``--components`` prints the matrix for each part of the step too (compute, exposed
communication, the rest): on the fresh set, compute within 20 % for 52/81 pairs (24/81 before the compute
share of FSDP's own work), the rest for 76/81 (70/81); exposed communication is the loosest (57/81, worst
x2.30: a DDP run's all-reduces, slowed by the backward beside them on the same cores, predict too much).

A third matrix, a diagnostic beside the goal, divides out each recording's CPU contention (rank.json
``cpu``: 1 + run-queue wait / time on a CPU, the median over ranks): predicted step / the contention the
model predicts for T, over measured step / the contention measured on T's run. On a shared machine the
load of other jobs changes from one recording to the next; this matrix shows the error of the rest of the
model without it (printed when the recordings have the field).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdpprof.analyze.load.files import with_inventory  # noqa: E402

from fsdpprof.analyze.load.run import load_run
from fsdpprof.analyze.whatif import predict as wp  # noqa: E402
from fsdpprof.analyze.whatif import targets as tg  # noqa: E402

EXAMPLE = ROOT / "fsdpprof" / "examples" / "train_fsdp.py"
STRATEGIES = [("fsdp2", 2), ("fsdp2-no-reshard", 2), ("hsdp", 4), ("fsdp2-offload", 2), ("fsdp1-full", 2),
              ("fsdp1-grad-op", 2), ("fsdp1-no-shard", 2), ("fsdp1-hybrid", 4), ("ddp", 2)]
RECORD = ("--skip-steps", "1", "--warmup-steps", "1", "--active-steps", "3")
TRAIN = ("--steps", "6")
PEAK_GOAL_PCT, STEP_GOAL = 10.0, 0.20


def record(strategy: str, nproc: int, out: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fsdpprof", "record", "--out", str(out), *RECORD, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(EXAMPLE), "--strategy", strategy, *TRAIN, "--quiet"]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"recording {strategy} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return time.perf_counter() - t


def analyse(path: Path) -> dict:
    """The run's own target, measured peak and step, and the model to predict from."""
    run = load_run(str(path), lazy=True)
    run.ranks = {r: with_inventory(rd)[0] for r, rd in run.ranks.items()}   # (a lazy run holds their paths)
    src = wp.source_of_rank(run.ranks[min(run.ranks)])
    return {"run": run, "target": tg.target_of_source(src)}


def fmt_row(name: str, cells: list[str], width: int = 10) -> str:
    return f"{name:>18s} " + " ".join(f"{c:>{width}s}" for c in cells)


def ratio_matrix(names: list[str], short: list[str], predicted: dict, measured: dict) -> tuple[int, float]:
    """Print median predicted / measured per (run predicted from, strategy predicted); (pairs within the step goal,
    worst ratio or its inverse)."""
    print(fmt_row("", short))
    ok, worst = 0, 1.0
    for a in names:
        cells = []
        for b in names:
            v = statistics.median(predicted[a][b]) / measured[b]
            cells.append(f"{v:.2f}")
            worst = max(worst, v, 1 / v) if v > 0 else worst
            ok += abs(v - 1.0) <= STEP_GOAL
        print(fmt_row(a, cells))
    return ok, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10, help="recordings per strategy (not used with --reuse)")
    ap.add_argument("--out", default=None, help="keep the recordings here (default: a temporary folder)")
    ap.add_argument("--reuse", nargs="+", default=None, metavar="DIR",
                    help="predict from recordings made before (folders --out wrote; their recordings pooled)")
    ap.add_argument("--strategies", default=",".join(s for s, _ in STRATEGIES))
    ap.add_argument("--components", action="store_true",
                    help="also print each part of the step (compute, exposed communication, the rest) predicted / "
                         "measured: where a step's error comes from")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
    strategies = [(s, n) for s, n in STRATEGIES if s in wanted]
    runs: dict[str, list[Path]] = {s: [] for s, _ in strategies}
    t_rec = 0.0
    if args.reuse:
        where = ", ".join(args.reuse)
        for s, _ in strategies:
            for folder in map(Path, args.reuse):
                found = [p for p in folder.glob(f"{s}-*") if re.fullmatch(rf"{re.escape(s)}-\d+", p.name)]
                runs[s] += sorted((p for p in found if (p / "run.json").exists()),
                                  key=lambda p: int(p.name.rsplit("-", 1)[1]))
    else:
        base = Path(args.out or tempfile.mkdtemp(prefix="bench-whatif-"))
        base.mkdir(parents=True, exist_ok=True)
        where = str(base)
        for rep in range(args.repeats):
            for s, n in strategies:
                out = base / f"{s}-{rep}"
                t_rec += record(s, n, out)
                if (out / "run.json").exists():
                    runs[s].append(out)
    print(f"recordings: {sum(len(v) for v in runs.values())} in {where} ({t_rec:.0f} s)")
    info = {s: [analyse(p) for p in paths] for s, paths in runs.items() if paths}
    names = list(info)
    targets = [info[s][0]["target"] for s in names]
    t0 = time.perf_counter()
    pred_peak = {a: {b: [] for b in names} for a in names}
    pred_step = {a: {b: [] for b in names} for a in names}
    pred_norm = {a: {b: [] for b in names} for a in names}
    parts = ("compute_us", "exposed_comm_us", "rest_us")
    pred_part = {k: {a: {b: [] for b in names} for a in names} for k in parts}
    meas_part = {k: {b: [] for b in names} for k in parts}
    meas_norm = {b: [] for b in names}
    meas_peak = {b: [] for b in names}
    meas_step = {b: [] for b in names}
    n_pred = 0
    for a in names:
        for rec in info[a]:
            res = wp.predict_run(rec["run"], targets, rec["target"])
            meas_peak[a].append(res["measured"]["peak_allocated_bytes"])
            meas_step[a].append(res["measured"]["step_us"])
            own = next(p for p in res["predictions"] if p["is_run"])
            for k in parts:
                meas_part[k][a].append(own[k])
            if own.get("run_cpu_contention"):
                meas_norm[a].append(res["measured"]["step_us"] / own["run_cpu_contention"])
            for b, p in zip(names, res["predictions"]):
                pred_peak[a][b].append(p["peak_allocated_bytes"])
                pred_step[a][b].append(p["step_us"])
                for k in parts:
                    pred_part[k][a][b].append(p[k])
                if p.get("cpu_contention"):
                    pred_norm[a][b].append(p["step_us"] / p["cpu_contention"])
                n_pred += 1
    t_pred = time.perf_counter() - t0
    med = statistics.median
    mp = {b: med(v) for b, v in meas_peak.items()}
    ms = {b: med(v) for b, v in meas_step.items()}
    n_runs = sum(len(v) for v in info.values())
    print(f"{n_pred} predictions in {t_pred:.1f} s ({1e3 * t_pred / max(n_runs, 1):.0f} ms per run "
          f"for all {len(names)} targets)\n")
    print("measured (median over repeats): peak MiB / step ms")
    for b in names:
        print(f"  {b:18s} {mp[b] / 2**20:8.2f} MiB  (repeats {', '.join(f'{x / 2**20:.2f}' for x in meas_peak[b])})"
              f"   {ms[b] / 1e3:8.1f} ms  (repeats {', '.join(f'{x / 1e3:.1f}' for x in meas_step[b])})")
    short = [b.replace("fsdp2-", "f2-").replace("fsdp1-", "f1-") for b in names]
    print("\npeak memory error, % (row: run predicted from; column: strategy predicted)")
    print(fmt_row("", short))
    worst_peak, ok_peak, n = 0.0, 0, 0
    for a in names:
        cells = []
        for b in names:
            v = 100.0 * (med(pred_peak[a][b]) / mp[b] - 1.0)
            cells.append(f"{v:+.1f}")
            worst_peak = max(worst_peak, abs(v))
            ok_peak += abs(v) <= PEAK_GOAL_PCT
            n += 1
        print(fmt_row(a, cells))
    print("\nstep time, predicted / measured")
    ok_step, worst_step = ratio_matrix(names, short, pred_step, ms)
    print(f"\npeak: {ok_peak}/{n} pairs within {PEAK_GOAL_PCT:.0f} % (worst {worst_peak:.1f} %); "
          f"step: {ok_step}/{n} pairs within {100 * STEP_GOAL:.0f} % (worst ratio x{worst_step:.2f})")
    if all(meas_norm[b] for b in names) and all(pred_norm[a][b] for a in names for b in names):
        mn = {b: med(v) for b, v in meas_norm.items()}
        print("\ndiagnostic: step time / CPU contention, predicted / measured (each recording's load divided out)")
        print("  measured step / contention, ms: " + ", ".join(f"{b} {mn[b] / 1e3:.1f}" for b in names))
        ok_norm, worst_norm = ratio_matrix(names, short, pred_norm, mn)
        print(f"diagnostic: {ok_norm}/{n} pairs within {100 * STEP_GOAL:.0f} % (worst ratio x{worst_norm:.2f})")
    if args.components:
        for k in parts:
            mk = {b: med(v) for b, v in meas_part[k].items()}
            print(f"\ndiagnostic: {k[:-3].replace('_', ' ')} per step, predicted / measured (measured medians, ms: "
                  + ", ".join(f"{b} {mk[b] / 1e3:.1f}" for b in names) + ")")
            ratio_matrix(names, short, pred_part[k], mk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
