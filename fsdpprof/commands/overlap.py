"""``fsdpprof overlap RUN``: per rank, communication overlapped with compute and exposed; per collective, its
volume and bandwidth (:func:`fsdpprof.analyze.pipeline.overlap_summary`), for scripts and CI checks."""
from __future__ import annotations

import json
import math
import sys

from fsdpprof.analyze.load.files import find_run
from fsdpprof.analyze.model import MISSING_WORD, fmt_bytes
from fsdpprof.commands import ENGINE, add, engine_of


def add_arguments(p) -> None:
    p.add_argument("run", metavar="RUN", help="run directory, folder of profiler traces, or trace file (.json[.gz])")
    add(p, "--json", "--max-trace-bytes", "--max-memory", *ENGINE,
        json="print the numbers as JSON (times in us, sizes in bytes, bandwidths in GB/s; null: undefined)")


def _cell(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(result) -> str:
    """The two tables of an OverlapSummary as text: overlap per rank (ms), volume per rank and collective."""
    lines = [f"fsdpprof overlap: {result.path} ({result.description})",
             "communication overlapped with compute, per rank (ms of the profiled window):",
             f"{'rank':>5} {'compute':>11} {'comm':>11} {'overlapped':>11} {'exposed':>11} {'overlap %':>9}"]
    for r in result.overlap.itertuples(index=False):
        lines.append(f"{r.rank:>5} {r.compute_us / 1e3:>11.3f} {r.comm_us / 1e3:>11.3f} "
                     f"{r.overlapped_comm_us / 1e3:>11.3f} {r.exposed_comm_us / 1e3:>11.3f} "
                     f"{_cell(r.comp_comm_overlap_pct, '.1f'):>9}")
    lines += ["", "collective volume and bandwidth, per rank (busbw: nccl-tests' bus bandwidth):",
              f"{'rank':>5} {'collective':<16} {'count':>6} {'size':>10} {'time ms':>10} {'algbw GB/s':>10} "
              f"{'busbw GB/s':>10}"]
    for v in result.volume.itertuples(index=False):
        coll = v.collective if isinstance(v.collective, str) else "(unknown)"
        size = fmt_bytes(v.bytes, missing=MISSING_WORD)   # binary units, as the report's (bandwidths: GB/s, nccl-tests')
        lines.append(f"{v.rank:>5} {coll[:16]:<16} {v.count:>6} {size:>10} {v.time_us / 1e3:>10.3f} "
                     f"{_cell(v.algbw_gbps, '.2f'):>10} {_cell(v.busbw_gbps, '.2f'):>10}")
    if not len(result.volume):
        lines.append("      (no communication in the trace)")
    return "\n".join(lines)


def run(args) -> int:
    engine = engine_of(args)
    run_ = find_run(args.run, workers=args.workers, max_trace_bytes=args.max_trace_bytes, max_memory=args.max_memory)
    from fsdpprof.analyze.pipeline import overlap_summary

    result = overlap_summary(run_, workers=args.workers, engine=engine, scheduler=args.scheduler)
    for line in result.warnings:
        print(f"fsdpprof overlap: warning: {line}", file=sys.stderr)
    for label, why in result.missing.items():
        print(f"fsdpprof overlap: {label} left out: {why}", file=sys.stderr)
    print(json.dumps(result.to_dict(), indent=1) if args.json else table(result))
    return 0
