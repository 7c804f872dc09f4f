"""``fsdpprof overlap RUN``: per rank, how much communication overlaps compute and how much is exposed; per
collective, its volume and bandwidth.  The quick path (:mod:`fsdpprof.analyze.comm.quick`): no numpy, no
pandas, no torch, so a script can run it over many traces (or a CI check on one) at little start-up cost."""
from __future__ import annotations

import json
import sys


def add_arguments(p) -> None:
    p.add_argument("run", metavar="RUN", help="run directory, folder of profiler traces, or trace file (.json[.gz])")
    p.add_argument("--json", action="store_true",
                   help="print the numbers as JSON (times in us, sizes in bytes, bandwidths in GB/s; null: undefined)")
    p.add_argument("--max-trace-bytes", type=int, default=None, metavar="BYTES",
                   help="largest trace accepted, in bytes of JSON once decompressed (default 8 GiB)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes reading ranks (default: one per rank and CPU core when the traces hold 4 MiB "
                        "of JSON or more; 1: this process only)")


def _cell(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _size(nbytes) -> str:
    """Decimal units, as the bandwidths beside them (GB/s = 1e9 bytes/s)."""
    from fsdpprof.analyze.model import fmt_bytes

    return fmt_bytes(nbytes, decimal=True)


def table(result) -> str:
    """The two tables as text: overlap per rank (ms), volume per rank and collective."""
    lines = ["communication overlapped with compute, per rank (ms of the profiled window):",
             f"{'rank':>5} {'compute':>11} {'comm':>11} {'overlapped':>11} {'exposed':>11} {'overlap %':>9}"]
    for r in result.overlap:
        lines.append(f"{r.rank:>5} {r.compute_us / 1e3:>11.3f} {r.comm_us / 1e3:>11.3f} "
                     f"{r.overlapped_comm_us / 1e3:>11.3f} {r.exposed_comm_us / 1e3:>11.3f} "
                     f"{_cell(r.comp_comm_overlap_pct, '.1f'):>9}")
    lines += ["", "collective volume and bandwidth, per rank (busbw: nccl-tests' bus bandwidth):",
              f"{'rank':>5} {'collective':<16} {'count':>6} {'bytes':>10} {'time ms':>10} {'algbw GB/s':>10} "
              f"{'busbw GB/s':>10}"]
    for v in result.volume:
        coll = "(unknown)" if v.collective is None else v.collective
        lines.append(f"{v.rank:>5} {coll[:16]:<16} {v.count:>6} {_size(v.bytes):>10} {v.time_us / 1e3:>10.3f} "
                     f"{_cell(v.algbw_gbps, '.2f'):>10} {_cell(v.busbw_gbps, '.2f'):>10}")
    if not result.volume:
        lines.append("      (no communication in the trace)")
    return "\n".join(lines)


def run(args) -> int:
    from fsdpprof.analyze.comm.quick import quick_overlap
    from fsdpprof.analyze.run import check_workers

    check_workers(args.workers, "--workers")
    result = quick_overlap(args.run, max_trace_bytes=args.max_trace_bytes, workers=args.workers)
    for line in result.warnings:
        print(f"fsdpprof overlap: warning: {line}", file=sys.stderr)
    for label, why in result.missing.items():
        print(f"fsdpprof overlap: {label} left out: {why}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(table(result))
    return 0
