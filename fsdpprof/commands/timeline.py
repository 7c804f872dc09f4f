"""``fsdpprof timeline INPUT -o OUT.json.gz``: every rank of a run as one process of one chrome trace (Perfetto),
on one clock, with fsdpprof's own tracks (step, stage, FSDP phase and unit, exposed communication, memory by
category, findings).  The file reads back as its ranks (``fsdpprof report OUT.json.gz``)."""
from __future__ import annotations

import os
import sys

from fsdpprof import options
from fsdpprof.analyze.model import fmt_bytes
from fsdpprof.commands import add, checked_run
from fsdpprof.errors import UserError
from fsdpprof.report.outputs import check_not_empty, timeline_path, write_files


def add_arguments(p) -> None:
    p.add_argument("run", metavar="INPUT", help="run directory, folder of profiler traces (any source), or one trace")
    p.add_argument("-o", "--output", default=None,
                   help="the timeline (.json.gz), or a folder to write it in (default: INPUT/timeline.json.gz for a "
                        "folder, X.timeline.json.gz beside a file X.json.gz)")
    p.add_argument("--ranks", type=options.ranks_list, default=None,
                   help="comma-separated ranks to keep (default all), e.g. 0,3,7")
    p.add_argument("--steps", type=options.steps_list, default=None,
                   help="comma-separated ProfilerStep numbers to keep (default all), e.g. 2,3")
    p.add_argument("--align", choices=("auto", "anchor", "collectives"), default="auto",
                   help="how the ranks' clocks are put on one: anchor (the clock anchor fsdpprof recorded in "
                        "rank.json), collectives (the ends of the collectives the ranks share: they end at nearly the "
                        "same moment on every rank), or auto (default: the anchor where recorded, unless it leaves "
                        "shared collectives over 1 ms further apart than their own alignment; else the collectives)")
    add(p, "--force", "--workers", "--max-trace-bytes", "--max-memory")


def run(args) -> int:
    check_not_empty(**{"INPUT": args.run, "-o": args.output})
    out = timeline_path(args.run, args.output)
    from fsdpprof.analyze.load.run import load_run

    run_ = checked_run(args, args.run, [(out, "-o" if args.output else "the timeline")], load=load_run,
                       workers=args.workers, max_trace_bytes=args.max_trace_bytes, max_memory=args.max_memory)
    if args.ranks is not None:
        absent = [r for r in args.ranks if r not in run_.ranks or run_.ranks[r].events is None]
        if absent:
            have = sorted(r for r, rd in run_.ranks.items() if rd.events is not None)
            raise UserError(f"--ranks: rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} "
                            f"{'are' if len(absent) > 1 else 'is'} not in {args.run} (ranks with a trace: "
                            f"{', '.join(map(str, have)) or 'none'}); pick ranks it has")
        run_.ranks = {r: rd for r, rd in run_.ranks.items() if r in args.ranks}
    from fsdpprof.analyze.comm.skew import ALIGN_ANCHOR, ALIGN_COLLECTIVES
    from fsdpprof.analyze.pipeline import analyze_run
    from fsdpprof.analyze.timeline import timeline_tracks
    from fsdpprof.report.timeline import WARN_BYTES, timeline_writer

    a = analyze_run(run_, workers=args.workers, progress=sys.stderr.isatty(), ops=False)
    align = {"anchor": ALIGN_ANCHOR, "collectives": ALIGN_COLLECTIVES}.get(args.align)
    tl = timeline_tracks(run_, a, args.steps, align)
    sizes: dict = {}
    write_files([(out, timeline_writer(run_, tl, args.steps, sizes))], fix="choose a writable path with -o")
    for line in tl.notes:
        print(f"fsdpprof timeline: {line}", file=sys.stderr)
    al = tl.alignment
    method = str(al["method"].iat[0]) if len(al) else "none"
    print(f"ranks on one clock ({method.replace('_', ' ')}): offset subtracted per rank, and how far its shared "
          f"collectives then end from the others' (median distance):")
    print(f"{'rank':>5} {'offset us':>14} {'residual us':>12}")
    for r in al.itertuples(index=False):
        res = "-" if r.residual_us != r.residual_us else f"{r.residual_us:.1f}"
        print(f"{r.rank:>5} {r.offset_us:>14.0f} {res:>12}")
    json_bytes, size = sizes.get("json_bytes", 0), fmt_bytes(os.path.getsize(out), decimal=True)
    if json_bytes > WARN_BYTES:
        print(f"fsdpprof timeline: warning: the timeline holds {fmt_bytes(json_bytes, decimal=True)} of JSON ({size} "
              f"compressed): Perfetto opens up to about 2 GB; keep fewer ranks or steps (--ranks, --steps)",
              file=sys.stderr)
    print(f"timeline: {out} ({size}; open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0
